"""The dataset vocabulary check, done once per dataset and remembered beside its index.

Every id must lie in [0, vocab_size); the id range is scanned once, under a file lock so ranks
sharing a filesystem scan a dataset once in all, and kept in the dataset's record with the .bin's
size and mtime. Why and how (NFS locks, read-only data): docs/data.md ("The data code").
"""

import os
import sys

import numpy as np

from megamamba.data.dataset_meta import record_token_range, recorded_token_range, token_range_record
from megamamba.data.errors import DatasetError
from megamamba.data.file_lock import exclusive_lock
from megamamba.data.progress import Progress

LOCK_SUFFIX = ".lock"  # beside the dataset: `<prefix>.lock`, taken by the process that scans
SCAN_TOKENS = 1 << 24  # tokens per chunk of a scan
PROGRESS_BYTES = 1 << 28  # scans of .bin files at least this large show progress


def scan_token_range(dataset, label: str, stream=sys.stderr) -> tuple[int, int]:
    """(smallest, largest) id of `dataset.tokens`, read chunk by chunk, with progress on large files."""
    tokens = dataset.tokens
    progress = Progress(tokens.nbytes, label, stream=stream) if tokens.nbytes >= PROGRESS_BYTES else None
    low, high = int(tokens[0]), int(tokens[0])
    for start in range(0, tokens.size, SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        if progress is not None:
            done = start + chunk.size
            progress.update(done * tokens.itemsize, int(np.searchsorted(dataset.offsets, done, side="right")) - 1)
    if progress is not None:
        progress.close()
    return low, high


def token_range(dataset, stream=sys.stderr) -> tuple[int, int]:
    """(smallest, largest) id of the dataset at `dataset.prefix`: recorded, or scanned once and recorded."""
    bin_path = dataset.prefix + ".bin"
    recorded = recorded_token_range(dataset.prefix, os.stat(bin_path))
    if recorded is not None:
        return recorded
    folder = os.path.dirname(os.path.abspath(bin_path))
    if not os.access(folder, os.W_OK):
        return scan_token_range(
            dataset, f"vocabulary check of {bin_path} (not recorded: {folder} is not writable)", stream
        )
    with exclusive_lock(dataset.prefix + LOCK_SUFFIX):
        stat = os.stat(bin_path)  # before the scan: a change during it leaves the record stale
        recorded = recorded_token_range(dataset.prefix, stat)  # written while this process waited for the lock
        if recorded is not None:
            return recorded
        low, high = scan_token_range(dataset, f"vocabulary check of {bin_path} (once: the result is recorded)", stream)
        try:
            record_token_range(dataset.prefix, token_range_record(stat, low, high))
        except OSError as e:  # a full disk, a quota: this run's check stands, the next start-up scans again
            stream.write(f"vocabulary check of {bin_path}: not recorded ({e}); the next start-up scans again\n")
    return low, high


def check_vocab(dataset, vocab_size: int, stream=sys.stderr) -> None:
    """Every token id in [0, vocab_size): else the data was made with another tokenizer (DatasetError)."""
    low, high = token_range(dataset, stream)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DatasetError(
            f"{dataset.prefix}.bin: token id {bad} is outside the vocabulary of {vocab_size} ids: "
            "the data was preprocessed with another tokenizer than the model's (or is corrupt)"
        )
