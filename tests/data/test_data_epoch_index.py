"""A large dataset's per-epoch packing arrays: built once beside it, memory-mapped, exactly what
packing in memory gives; small or unwritable datasets keep them in memory."""

import os
import threading

import numpy as np
import pytest

from data_fixtures import labelled_documents, write_dataset
from megamamba.data import epoch_index
from megamamba.data.indexed import IndexedDataset
from megamamba.data.packing import DocumentPacker
from megamamba.data.split import DocumentRange

SEQ = 19


@pytest.fixture
def dataset(tmp_path):
    return IndexedDataset(write_dataset(str(tmp_path / "big"), labelled_documents(80, seed=4)))


@pytest.fixture
def indexed(monkeypatch):
    """Every dataset counts as large: its epoch arrays go to disk."""
    monkeypatch.setattr(epoch_index, "INDEX_DOCUMENTS", 1)


def samples(packer, count):
    return [packer.sample(q) for q in range(count)]


def test_mapped_epochs_pack_exactly_the_samples_of_in_memory_epochs(dataset, indexed, monkeypatch):
    packer = DocumentPacker(dataset, SEQ, seed=7, key=1)
    count = 3 * packer.samples_per_epoch  # three epochs: more than the packer caches
    mapped = samples(packer, count)
    monkeypatch.setattr(epoch_index, "INDEX_DOCUMENTS", 10**9)
    in_memory = samples(DocumentPacker(dataset, SEQ, seed=7, key=1), count)
    for q, ((tokens, ids), (ref_tokens, ref_ids)) in enumerate(zip(mapped, in_memory)):
        assert np.array_equal(tokens, ref_tokens) and np.array_equal(ids, ref_ids), f"sample {q}"
    assert len(os.listdir(dataset.prefix + ".epochs")) == 3 * len(epoch_index.NAMES) + 1  # + the lock file


def test_a_second_start_up_maps_the_files_and_builds_nothing(dataset, indexed, monkeypatch):
    first = DocumentPacker(dataset, SEQ, seed=7, key=0).sample(5)
    monkeypatch.setattr(DocumentPacker, "_build_epoch", lambda self, epoch: pytest.fail("epoch rebuilt"))
    again = DocumentPacker(dataset, SEQ, seed=7, key=0)
    tokens, ids = again.sample(5)
    assert np.array_equal(tokens, first[0]) and np.array_equal(ids, first[1])
    assert all(isinstance(a, np.memmap) for a in again._epochs[0])


def test_other_seeds_keys_and_sequence_lengths_get_their_own_files(dataset, indexed):
    for seed, key, seq in ((7, 0, SEQ), (8, 0, SEQ), (7, 1, SEQ), (7, 0, SEQ + 2)):
        DocumentPacker(dataset, seq, seed=seed, key=key).sample(0)
    assert len(os.listdir(dataset.prefix + ".epochs")) == 4 * len(epoch_index.NAMES) + 1


def test_a_truncated_file_is_rebuilt_not_trusted(dataset, indexed):
    reference = DocumentPacker(dataset, SEQ, seed=7, key=0).sample(3)
    base = epoch_index.index_base(dataset, 7, 0, SEQ, 0)
    np.save(f"{base}.samples.npy", np.arange(2))
    tokens, ids = DocumentPacker(dataset, SEQ, seed=7, key=0).sample(3)
    assert np.array_equal(tokens, reference[0]) and np.array_equal(ids, reference[1])


def test_processes_starting_together_build_an_epoch_once(dataset, indexed, monkeypatch):
    builds, build = [], DocumentPacker._build_epoch

    def counted(self, epoch):
        builds.append(epoch)
        return build(self, epoch)

    monkeypatch.setattr(DocumentPacker, "_build_epoch", counted)
    results = [None] * 4

    def start(i):  # separate open() calls: flock excludes them as it excludes processes
        results[i] = DocumentPacker(dataset, SEQ, seed=7, key=0).sample(2)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [0]
    assert all(np.array_equal(r[0], results[0][0]) for r in results)


def test_a_rewritten_dataset_of_the_same_size_gets_new_epochs(dataset, indexed, monkeypatch):
    DocumentPacker(dataset, SEQ, seed=7, key=0).sample(0)
    documents = labelled_documents(80, seed=4)
    documents[0], documents[1] = documents[0] + documents[1][1:], documents[1][:1]  # same counts, other lengths
    rewritten = IndexedDataset(write_dataset(dataset.prefix, documents))
    assert (rewritten.num_documents, rewritten.num_tokens) == (dataset.num_documents, dataset.num_tokens)
    mapped = samples(DocumentPacker(rewritten, SEQ, seed=7, key=0), 4)
    monkeypatch.setattr(epoch_index, "INDEX_DOCUMENTS", 10**9)
    in_memory = samples(DocumentPacker(rewritten, SEQ, seed=7, key=0), 4)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(mapped, in_memory))


def test_a_split_part_gets_files_of_its_own_document_range(dataset, indexed):
    part = DocumentRange(dataset, 10, 50, "train")
    DocumentPacker(part, SEQ, seed=7, key=0).sample(0)
    DocumentPacker(dataset, SEQ, seed=7, key=0).sample(0)
    names = os.listdir(dataset.prefix + ".epochs")
    assert any("-docs10-50-" in n for n in names) and any("-80docs-" in n for n in names)


def test_small_datasets_keep_their_epochs_in_memory(dataset):
    DocumentPacker(dataset, SEQ, seed=7, key=0).sample(0)
    assert not os.path.exists(dataset.prefix + ".epochs")


def test_a_dataset_folder_where_nothing_can_be_written_keeps_the_epochs_in_memory(dataset, indexed):
    with open(dataset.prefix + ".epochs", "w"):  # the folder cannot be made (as on read-only data)
        pass
    tokens, _ = DocumentPacker(dataset, SEQ, seed=7, key=0).sample(0)
    assert tokens.size == SEQ + 1 and os.path.isfile(dataset.prefix + ".epochs")
