"""The dataset check at every start-up: the .bin's content against its recorded checksum, its ids against
the vocabulary.

Every id must lie in [0, vocab_size). The id range and the checksum are kept in the dataset's record:
preprocessing records them as it writes; a dataset without them (Megatron's, or older) is scanned once,
under a file lock so ranks sharing a filesystem scan it once in all, and they are recorded then.
Each start-up computes the checksum again (cheap: checksum.py) and trusts the range only when it matches.
Why and how (NFS locks, read-only data): docs/data.md ("The data code").
"""

import os
import sys
from typing import Optional

import numpy as np

from megamamba.data.checksum import Checksum, check_file
from megamamba.data.dataset_meta import meta_path, record_token_range, recorded_tokens, token_range_record
from megamamba.data.errors import DatasetError
from megamamba.data.file_lock import exclusive_lock
from megamamba.data.progress import Progress

LOCK_SUFFIX = ".lock"  # beside the dataset: `<prefix>.lock`, taken by the process that scans
SCAN_TOKENS = 1 << 24  # tokens per chunk of a scan
PROGRESS_BYTES = 1 << 28  # scans of .bin files at least this large show progress
PREPROCESS = "python -m megamamba.data.preprocess"


def scan_token_range(dataset, label: str, stream=sys.stderr) -> tuple[int, int, str]:
    """(smallest id, largest id, checksum) of `dataset.tokens`, read chunk by chunk, with progress on large files."""
    tokens = dataset.tokens
    progress = Progress(tokens.nbytes, label, stream=stream) if tokens.nbytes >= PROGRESS_BYTES else None
    low, high = int(tokens[0]), int(tokens[0])
    checksum = Checksum()
    for start in range(0, tokens.size, SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        checksum.update(chunk)
        if progress is not None:
            done = start + chunk.size
            progress.update(done * tokens.itemsize, int(np.searchsorted(dataset.offsets, done, side="right")) - 1)
    if progress is not None:
        progress.close()
    return low, high, checksum.text()


def _checked_range(dataset, tokens: dict, stream) -> tuple[int, int]:
    """The recorded (min id, max id), once the .bin's checksum is found equal to the recorded one."""
    check_file(dataset, tokens["checksum"], meta_path(dataset.prefix), stream)
    return tokens["min_id"], tokens["max_id"]


def token_range(dataset, stream=sys.stderr) -> tuple[int, int, Optional[str]]:
    """(smallest id, largest id, a warning or None) of the dataset at `dataset.prefix`: recorded and the content
    checked against the recorded checksum; without one, scanned once and recorded, with a warning saying so."""
    tokens = recorded_tokens(dataset.prefix)
    if tokens is not None:
        return (*_checked_range(dataset, tokens, stream), None)
    bin_path = dataset.prefix + ".bin"
    unrecorded = f"{bin_path}: no checksum recorded (written before checksums were, or by another tool)"
    folder = os.path.dirname(os.path.abspath(bin_path))
    if not os.access(folder, os.W_OK):
        label = f"vocabulary check of {bin_path} (not recorded: {folder} is not writable)"
        low, high, _ = scan_token_range(dataset, label, stream)
        warning = (
            f"{unrecorded} and {folder} is not writable: its content cannot be checked; re-run {PREPROCESS}, "
            "or start once with write access there, to record one"
        )
        return low, high, warning
    with exclusive_lock(dataset.prefix + LOCK_SUFFIX):
        tokens = recorded_tokens(dataset.prefix)  # written while this process waited for the lock
        if tokens is not None:
            return (*_checked_range(dataset, tokens, stream), None)
        label = f"vocabulary check of {bin_path} (once: the result is recorded)"
        low, high, checksum = scan_token_range(dataset, label, stream)
        try:
            record_token_range(dataset.prefix, token_range_record(low, high, checksum))
            warning = (
                f"{unrecorded}: recorded {checksum} from its content as it is now, which later start-ups check it "
                f"against (re-run {PREPROCESS} to record one from the source text instead)"
            )
        except OSError as e:  # a full disk, a quota: this run's check stands, the next start-up scans again
            warning = (
                f"{unrecorded}; recording one failed ({e}): its content cannot be checked; "
                "the next start-up tries again"
            )
    return low, high, warning


def check_vocab(dataset, vocab_size: int, stream=sys.stderr) -> Optional[str]:
    """Every token id in [0, vocab_size), else DatasetError (the data was made with another tokenizer); returns
    token_range's warning."""
    low, high, warning = token_range(dataset, stream)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DatasetError(
            f"{dataset.prefix}.bin: token id {bad} is outside the vocabulary of {vocab_size} ids: "
            "the data was preprocessed with another tokenizer than the model's (or is corrupt)"
        )
    return warning
