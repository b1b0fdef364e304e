"""The index is checked and read in chunks: a dataset spanning many chunks reads and fails exactly as in one."""

import struct

import numpy as np
import pytest

from data_fixtures import write_dataset
from megamamba.data import indexed
from megamamba.data.indexed import DatasetError, IndexedDataset

DOCS = [[d + 1] * (d % 3 + 1) + [0] for d in range(7)]  # 7 sequences: chunks of 2 leave a partial last one
HEADER = 34


@pytest.fixture
def prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed, "_CHECK_SEQUENCES", 2)
    return write_dataset(str(tmp_path / "d"), DOCS)


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_documents_across_chunks_read_back_whole(prefix):
    ds = IndexedDataset(prefix)
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == DOCS
    assert ds.num_tokens == sum(map(len, DOCS)) and ds.offsets.dtype == np.int64


def test_a_wrong_pointer_in_a_later_chunk_is_named(prefix):
    patch(prefix + ".idx", HEADER + 4 * 7 + 8 * 5, struct.pack("<q", 2))
    with pytest.raises(
        DatasetError,
        match=r"corrupt: sequence 5 points to byte 2, but the sequences before it "
        r"end at byte 28",
    ):
        IndexedDataset(prefix)


def test_a_negative_length_in_a_later_chunk_is_named(prefix):
    patch(prefix + ".idx", HEADER + 4 * 4, struct.pack("<i", -1))
    with pytest.raises(DatasetError, match=r"corrupt: negative sequence length at sequence 4"):
        IndexedDataset(prefix)


def test_a_document_index_decreasing_across_a_chunk_boundary_is_refused(prefix):
    patch(prefix + ".idx", HEADER + 12 * 7 + 8 * 2, struct.pack("<q", 4))  # documents: 0 1 4 3 ...
    with pytest.raises(DatasetError, match=r"corrupt: the document index decreases"):
        IndexedDataset(prefix)
