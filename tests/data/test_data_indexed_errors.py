"""A corrupt, truncated, empty or mismatched dataset fails at open with a message naming the problem."""

import struct

import numpy as np
import pytest

from data_fixtures import write_dataset
from megamamba.data.indexed import DatasetError, IndexedDataset, IndexedDatasetWriter

DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest.fixture
def prefix(tmp_path):
    return write_dataset(str(tmp_path / "d"), DOCS)


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_intact_dataset_reads_its_documents(prefix):
    ds = IndexedDataset(prefix, vocab_size=10)
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == DOCS
    assert ds.num_tokens == 9


CORRUPTIONS = {
    "bad magic": (lambda p: patch(p + ".idx", 0, b"NOTANIDX\x00"), r"d.idx: not an indexed-dataset index: starts with"),
    "bad version": (lambda p: patch(p + ".idx", 9, struct.pack("<Q", 2)), r"d.idx: index version 2; only version 1"),
    "unknown dtype": (lambda p: patch(p + ".idx", 17, bytes([9])), r"d.idx: unknown token dtype code 9"),
    "float dtype": (lambda p: patch(p + ".idx", 17, bytes([7])), r"d.idx: token dtype float32 is not an integer type"),
    "idx cut in header": (
        lambda p: cut(p + ".idx", 20),
        r"d.idx: truncated: 20 bytes, shorter than the 34-byte header",
    ),
    "idx cut in arrays": (
        lambda p: cut(p + ".idx", 60),
        r"d.idx: truncated: 60 bytes, its header \(3 sequences, 4 "
        r"document-index entries\) implies 102",
    ),
    "idx with trailing bytes": (lambda p: open(p + ".idx", "ab").write(b"\x00" * 5), r"d.idx: has trailing bytes"),
    "bin truncated": (
        lambda p: cut(p + ".bin", 10),
        r"d.bin: truncated: 10 bytes, the index describes 18 "
        r"\(9 tokens of uint16\)",
    ),
    "bin too long": (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), r"d.bin: longer than its index says"),
    "pointer off": (
        lambda p: patch(p + ".idx", 34 + 12 + 8, struct.pack("<q", 4)),
        r"d.idx: corrupt: sequence 1 points to byte 4, but the sequences before it end at byte 6",
    ),
    "negative length": (lambda p: patch(p + ".idx", 34, struct.pack("<i", -3)), r"d.idx: corrupt: negative sequence"),
    "document index": (
        lambda p: patch(p + ".idx", 34 + 36 + 24, struct.pack("<q", 2)),
        r"d.idx: corrupt: the document index must run from 0 to the 3 sequences",
    ),
    "missing bin": (lambda p: __import__("os").remove(p + ".bin"), r"d.bin: no such file"),
    "not an index at all": (lambda p: open(p + ".idx", "wb").write(b"hello"), r"d.idx: not an indexed-dataset index"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_files_fail_with_a_clear_message(prefix, name):
    damage, message = CORRUPTIONS[name]
    damage(prefix)
    with pytest.raises(DatasetError, match=message):
        IndexedDataset(prefix)


def test_empty_dataset_fails_clearly(tmp_path):
    prefix = str(tmp_path / "e")
    IndexedDatasetWriter(prefix, np.uint16).finalize()
    with pytest.raises(DatasetError, match=r"e: empty dataset \(0 documents, 0 tokens\)"):
        IndexedDataset(prefix)


def test_token_beyond_the_vocabulary_is_a_tokenizer_mismatch(prefix):
    IndexedDataset(prefix, vocab_size=10)
    with pytest.raises(
        DatasetError,
        match=r"d.bin: token id 9 is outside the vocabulary of 9 ids: the data was "
        r"preprocessed with another tokenizer",
    ):
        IndexedDataset(prefix, vocab_size=9)


def test_negative_token_is_refused(tmp_path):
    prefix = write_dataset(str(tmp_path / "s"), [[3, -1]], dtype=np.int32)
    with pytest.raises(DatasetError, match="token id -1 is outside the vocabulary"):
        IndexedDataset(prefix, vocab_size=100)
