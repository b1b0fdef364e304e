"""A node reads a dataset's .bin for its checksum once: its ranks and later start-ups trust the note of that
check while the file is unchanged (device, inode, size, modification and status-change times), and read it
again, refusing it if it is damaged, once any of them moved."""

import io
import time

import pytest

from data_fixtures import corrupt_in_place
from megamamba.data import checksum, verified_files
from megamamba.data.indexed import DatasetError, IndexedDataset
from megamamba.data.preprocess import preprocess


@pytest.fixture
def preprocessed(corpus_jsonl, tmp_path, monkeypatch):
    monkeypatch.setattr(verified_files.tempfile, "tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    (prefix,) = preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=io.StringIO())
    return prefix


def _reads(monkeypatch) -> list:
    """The .bin files read for their checksum from now on."""
    read = []
    real = checksum.file_checksum

    def counted(dataset, stream):
        read.append(dataset.prefix)
        return real(dataset, stream)

    monkeypatch.setattr(checksum, "file_checksum", counted)
    return read


def test_an_unchanged_dataset_is_read_once_by_a_node(preprocessed, monkeypatch):
    monkeypatch.setattr(verified_files, "SETTLED_NS", 0)  # as if the file were written long before the check
    reads = _reads(monkeypatch)
    for _ in range(3):
        IndexedDataset(preprocessed, vocab_size=257)
    assert reads == [preprocessed]


def test_a_bin_changed_in_place_after_the_check_is_read_again_and_refused(preprocessed, monkeypatch):
    monkeypatch.setattr(verified_files, "SETTLED_NS", 0)
    IndexedDataset(preprocessed, vocab_size=257)
    time.sleep(0.05)  # past the file system's clock tick: the change moves the status-change time
    corrupt_in_place(preprocessed + ".bin", 14, 65000)
    with pytest.raises(DatasetError, match=r"\.bin: checksum crc32:\w+, but .* records crc32:"):
        IndexedDataset(preprocessed, vocab_size=257)


def test_a_note_on_a_file_changed_just_before_its_check_is_not_trusted(preprocessed, monkeypatch):
    reads = _reads(monkeypatch)
    IndexedDataset(preprocessed, vocab_size=257)
    corrupt_in_place(preprocessed + ".bin", 14, 65000)  # maybe within the clock tick of the check's stat
    with pytest.raises(DatasetError, match=r"the file changed after it was recorded"):
        IndexedDataset(preprocessed, vocab_size=257)
    assert reads == [preprocessed, preprocessed]
