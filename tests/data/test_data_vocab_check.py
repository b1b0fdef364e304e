"""The vocabulary check scans a dataset's tokens once: later start-ups trust its record while the .bin's checksum
matches it (the checksum itself: test_data_integrity.py)."""

import fcntl
import io
import json
import os
import stat
import threading
import time
import zlib

import numpy as np
import pytest

from data_fixtures import write_dataset
from megamamba.data import vocab_check
from megamamba.data.dataset_meta import META_SUFFIX, read_tokenizer_record
from megamamba.data.indexed import DatasetError, IndexedDataset
from megamamba.data.preprocess import preprocess

DOCS = [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]]


@pytest.fixture
def scans(monkeypatch):
    """The number of scans of .bin files made so far (every scan is counted, then done as usual)."""
    count = [0]
    real = vocab_check.scan_token_range

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(vocab_check, "scan_token_range", counted)
    return count


def tokens_record(prefix):
    with open(prefix + META_SUFFIX) as f:
        return json.load(f)["tokens"]


def test_preprocess_records_the_token_range_and_checksum_of_what_it_wrote(corpus_jsonl, tmp_path):
    (prefix,) = preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=io.StringIO())
    content = open(prefix + ".bin", "rb").read()
    tokens = np.frombuffer(content, np.uint16)
    assert tokens_record(prefix) == {
        "checksum": f"crc32:{zlib.crc32(content):08x}",
        "min_id": int(tokens.min()),
        "max_id": int(tokens.max()),
    }


def test_a_preprocessed_dataset_is_checked_without_reading_a_token(corpus_jsonl, tmp_path, scans):
    (prefix,) = preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=io.StringIO())
    IndexedDataset(prefix, vocab_size=257)
    assert scans[0] == 0


def test_a_dataset_without_a_record_is_scanned_once_then_trusted(tmp_path, scans):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    IndexedDataset(prefix, vocab_size=10)
    assert scans[0] == 1 and tokens_record(prefix)["max_id"] == 9
    IndexedDataset(prefix, vocab_size=10)
    assert scans[0] == 1


def test_a_dataset_made_by_another_tool_keeps_its_missing_tokenizer_record(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    IndexedDataset(prefix, vocab_size=10)
    assert read_tokenizer_record(prefix) is None and os.path.exists(prefix + META_SUFFIX)


def test_a_dataset_rewritten_by_another_writer_under_its_old_record_is_refused_by_its_checksum(tmp_path, scans):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    IndexedDataset(prefix, vocab_size=10)
    write_dataset(prefix, DOCS + [[12, 0]])  # another .bin (and size) under the old record
    with pytest.raises(DatasetError, match=r"d.bin: checksum crc32:\w{8}, but .*d.meta.json records crc32:"):
        IndexedDataset(prefix, vocab_size=10)
    assert scans[0] == 1


def test_an_id_beyond_the_vocabulary_is_refused_from_the_record_too(tmp_path, scans):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    for _ in range(2):
        with pytest.raises(DatasetError, match=r"d.bin: token id 9 is outside the vocabulary of 9 ids"):
            IndexedDataset(prefix, vocab_size=9)
    assert scans[0] == 1


def test_ranks_starting_together_scan_a_dataset_once(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    count = [0]
    real = vocab_check.scan_token_range

    def slow_scan(*args, **kwargs):
        count[0] += 1
        time.sleep(0.2)  # the others arrive while this one scans, and wait on its lock
        return real(*args, **kwargs)

    monkeypatch.setattr(vocab_check, "scan_token_range", slow_scan)
    errors = []

    def rank():
        try:
            IndexedDataset(prefix, vocab_size=10)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and count[0] == 1


def test_the_scan_lock_is_taken_on_a_writable_lock_file_beside_the_dataset_not_on_the_bin(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    locked = []
    real = fcntl.flock

    def recorded(fd, operation):  # NFS refuses an exclusive lock on a read-only descriptor
        writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        locked.append((os.fstat(fd).st_ino, writable))
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", recorded)
    IndexedDataset(prefix, vocab_size=10)
    assert locked == [(os.stat(prefix + vocab_check.LOCK_SUFFIX).st_ino, True)]


def test_a_dataset_whose_lock_file_cannot_be_created_is_scanned_without_a_lock(tmp_path, scans):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    os.mkdir(prefix + vocab_check.LOCK_SUFFIX)  # open(..., "a") fails on a directory
    IndexedDataset(prefix, vocab_size=10)
    assert scans[0] == 1 and tokens_record(prefix)["max_id"] == 9


def test_a_large_scan_shows_progress_as_plain_lines_off_a_terminal(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    monkeypatch.setattr(vocab_check, "PROGRESS_BYTES", 0)
    monkeypatch.setattr(vocab_check, "SCAN_TOKENS", 4)
    stream = io.StringIO()
    assert vocab_check.token_range(IndexedDataset(prefix), stream)[:2] == (0, 9)
    text = stream.getvalue()
    assert "\r" not in text and text.splitlines()[-1].startswith(
        f"vocabulary check of {prefix}.bin (once: the result is recorded): 100.0% | 3 docs |"
    )


def test_a_dataset_in_a_directory_it_cannot_write_is_scanned_and_says_why(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    monkeypatch.setattr(vocab_check.os, "access", lambda path, mode: False)
    monkeypatch.setattr(vocab_check, "PROGRESS_BYTES", 0)
    stream = io.StringIO()
    low, high, warning = vocab_check.token_range(IndexedDataset(prefix), stream)
    assert (low, high) == (0, 9)
    assert f"(not recorded: {tmp_path} is not writable)" in stream.getvalue()
    assert warning == (
        f"{prefix}.bin: no checksum recorded (written before checksums were, or by another tool) and {tmp_path} is "
        "not writable: its content cannot be checked; re-run python -m megamamba.data.preprocess, or start once "
        "with write access there, to record one"
    )
    assert not os.path.exists(prefix + META_SUFFIX)


def test_the_record_is_as_readable_as_the_dataset_and_leaves_no_temporary_file(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    IndexedDataset(prefix, vocab_size=10)
    mode = stat.S_IMODE(os.stat(prefix + META_SUFFIX).st_mode)
    assert mode == stat.S_IMODE(os.stat(prefix + ".bin").st_mode), oct(mode)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.lock", "d.meta.json"]


def test_a_record_that_cannot_be_written_leaves_the_check_standing_and_says_so(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vocab_check, "record_token_range", full_disk)
    assert vocab_check.token_range(IndexedDataset(prefix), io.StringIO()) == (
        0,
        9,
        f"{prefix}.bin: no checksum recorded (written before checksums were, or by another tool); recording one "
        "failed ([Errno 28] No space left on device): its content cannot be checked; the next start-up tries again",
    )
