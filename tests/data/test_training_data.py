"""train.py's data: built-in corpus or preprocessed blends, validation, seq_idx, and refusals before start-up."""

import re

import numpy as np
import pytest

from megamamba import MambaConfig
from megamamba.data.indexed import IndexedDatasetWriter
from megamamba.data.training_data import BUILTIN_VALID_FRACTION, builtin_datasets, training_data
from megamamba.tokenizer import load_tokenizer
from train_entry import ROOT

TINY = MambaConfig.from_json(ROOT / "launch/models/tiny-mamba2.json")  # vocab 257: the byte tokenizer's
SEED = 5


def _dataset(prefix, documents):
    writer = IndexedDatasetWriter(str(prefix), np.dtype(np.uint16))
    for doc in documents:
        writer.add_document(np.asarray(doc, dtype=np.uint16))
    writer.finalize()
    return str(prefix)


def _short_documents(count, label, eod=256):
    """Documents of 3..9 copies of `label + d`, each closed by the byte tokenizer's end-of-document id."""
    return [[label + d % 50] * (3 + d % 7) + [eod] for d in range(count)]


def test_builtin_corpus_splits_whole_documents_and_ends_each_with_the_end_of_document_id():
    tok = load_tokenizer("bytes")
    train, valid = builtin_datasets(tok)
    total = train.num_documents + valid.num_documents
    assert abs(valid.num_documents - BUILTIN_VALID_FRACTION * total) <= 2, (valid.num_documents, total)
    for docs in (train, valid):
        ends = docs.tokens[docs.offsets[1:] - 1]
        assert (ends == tok.eod).all() and (np.diff(docs.offsets) > 1).all()
    train_texts = {tok.decode(train.tokens[a:b]) for a, b in zip(train.offsets[:-1], train.offsets[1:])}
    assert not any(tok.decode(valid.tokens[a:b]) in train_texts for a, b in zip(valid.offsets[:-1], valid.offsets[1:]))


def test_blend_batches_carry_seq_idx_at_document_boundaries_unless_turned_off(tmp_path):
    a = _dataset(tmp_path / "a", _short_documents(200, 1))
    b = _dataset(tmp_path / "b", _short_documents(200, 100))
    data = training_data(TINY, "bytes", ["0.75", a, "0.25", b], [b], 24, 8, SEED)
    inputs, labels, seq_idx = data.train.rows_at(24, 32)
    assert inputs.shape == labels.shape == seq_idx.shape == (8, 24) and seq_idx.dtype.is_signed
    # The id steps up at each end-of-document input, whose label starts the next document.
    steps = seq_idx[:, 1:] - seq_idx[:, :-1]
    assert ((steps == 1) == (inputs[:, 1:] == 256)).all() and seq_idx.max() > 1
    assert data.valid is not None and not np.array_equal(data.valid.rows_at(0, 8)[0], data.train.rows_at(0, 8)[0])
    off = training_data(TINY, "bytes", [a], [], 24, 8, SEED, reset_at_documents=False)
    off_inputs, _, off_seq_idx = off.train.rows_at(24, 32)
    assert off_seq_idx is None and off_inputs.shape == (8, 24)


@pytest.mark.parametrize(
    "data, valid, needs_validation, words",
    [
        ([], ["x"], False, "--valid-data without --data"),
        (["{a}"], [], True, "--eval-interval > 0 with --data needs --valid-data"),
        (["{big}"], [], False, "token id 300 is outside the vocabulary of 257 ids"),
        (["0.5", "{a}", "{a}"], [], False, "expected pairs 'weight prefix'"),
        (["{tmp}/missing"], [], False, "missing.idx: no such file"),
    ],
)
def test_unusable_data_flags_are_refused_with_the_value_named(tmp_path, data, valid, needs_validation, words):
    paths = {
        "a": _dataset(tmp_path / "a", _short_documents(50, 1)),
        "big": _dataset(tmp_path / "big", [[300, 256]] * 40),
        "tmp": str(tmp_path),
    }
    with pytest.raises((ValueError, OSError), match=re.escape(words)):
        training_data(
            TINY, "bytes", [d.format(**paths) for d in data], valid, 8, 4, SEED, needs_validation=needs_validation
        )


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused():
    small = MambaConfig.from_dict({**TINY.to_dict(), "vocab_size": 200})
    with pytest.raises(ValueError, match="has 257 ids but the model config's vocab_size is 200"):
        training_data(small, "bytes", [], [], 8, 4, SEED)
