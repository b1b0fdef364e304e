"""A training run's data from its flags: the tokenizer and the train and validation global batches.

Runs before any process group exists; each refusal is one message naming the offending value,
and reservations go to `TrainingData.warnings`. The flags: docs/data.md and docs/flags.md.
"""

import argparse
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from megamamba.config import MambaConfig
from megamamba.data.batches import PackedGlobalBatches, open_blend
from megamamba.data.blend import parse_blend
from megamamba.data.corpus import default_corpus
from megamamba.data.dataset_meta import check_tokenizer
from megamamba.data.preprocess import is_validation
from megamamba.data.split import split_blend
from megamamba.tokenizer import Tokenizer, check_vocab, load_tokenizer

BUILTIN_VALID_FRACTION = 0.05
BUILTIN_NAME = "<built-in corpus>"


class DocumentTokens:
    """Tokenized documents held in memory, read by the packer as it reads an `IndexedDataset`."""

    def __init__(self, name: str, documents: Sequence[list]):
        if not documents:
            raise ValueError(f"{name}: no documents")
        self.prefix = name
        lengths = np.array([len(d) for d in documents], dtype=np.int64)
        self.offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        self.tokens = np.fromiter((t for d in documents for t in d), dtype=np.int64, count=int(self.offsets[-1]))
        self.num_tokens = int(self.offsets[-1])

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    def locate(self, position: int) -> str:
        """Where `tokens[position]` is, for messages."""
        return f"{self.prefix}, token {position}"


def builtin_datasets(tokenizer: Tokenizer) -> tuple[DocumentTokens, DocumentTokens]:
    """(train, validation) of the built-in corpus: each document's tokens then the end-of-document id."""
    split = ([], [])
    for number, text in enumerate(t for t in default_corpus() if t):
        split[is_validation(number, BUILTIN_VALID_FRACTION)].append(tokenizer.encode(text) + [tokenizer.eod])
    return DocumentTokens(BUILTIN_NAME + " train", split[0]), DocumentTokens(BUILTIN_NAME + " valid", split[1])


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train: PackedGlobalBatches
    valid: Optional[PackedGlobalBatches]
    warnings: list = field(default_factory=list)


def training_data(
    model: MambaConfig,
    tokenizer_spec: str,
    data: Sequence[str],
    valid_data: Sequence[str],
    seq_length: int,
    global_batch_size: int,
    seed: int,
    reset_at_documents: bool = True,
    needs_validation: bool = False,
    allow_tokenizer_mismatch: bool = False,
    split: Optional[str] = None,
) -> TrainingData:
    """The run's data (see the module docstring); ValueError/OSError with one message when unusable."""
    tokenizer = load_tokenizer(tokenizer_spec)
    check_vocab(model, tokenizer)
    if not data and valid_data:
        raise ValueError("--valid-data without --data: the built-in corpus brings its own validation split")
    if split is not None and not data:
        raise ValueError("--split without --data: the built-in corpus brings its own validation split")
    if split is not None and valid_data:
        raise ValueError("--split and --valid-data both give validation data: keep one (--split carves it from --data)")
    prefixes = dict.fromkeys(p for blend in (data, valid_data) if blend for _, p in parse_blend(blend))
    notes = [check_tokenizer(p, tokenizer, tokenizer_spec, allow_tokenizer_mismatch) for p in prefixes]
    if data:
        train_sets, train_weights = open_blend(data, tokenizer.vocab_size)
        valid = open_blend(valid_data, tokenizer.vocab_size) if valid_data else None
        notes += [d.warning for d in train_sets + (valid[0] if valid else [])]
        if split is not None:
            parts = split_blend(train_sets, split)
            train_sets = parts.train
            valid = (parts.valid, train_weights) if parts.valid is not None else None
    else:
        train_set, valid_set = builtin_datasets(tokenizer)
        (train_sets, train_weights), valid = ([train_set], [1]), ([valid_set], [1])
    if needs_validation and valid is None:
        raise ValueError(
            "--eval-interval > 0 with --data needs --valid-data (e.g. the <prefix>_valid "
            "datasets that preprocess --valid-fraction writes) or a --split with a validation part "
            "(e.g. --split 969,30,1)"
        )
    vocab = tokenizer.vocab_size
    train = PackedGlobalBatches(
        train_sets, train_weights, seq_length, global_batch_size, seed, reset_at_documents, vocab
    )
    if valid is not None:
        valid = PackedGlobalBatches(*valid, seq_length, global_batch_size, seed + 1, reset_at_documents, vocab)
    return TrainingData(tokenizer, train, valid, [n for n in notes if n])


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's data and tokenizer flags (docs/flags.md)."""
    p = parser.add_argument_group("data and tokenizer")
    p.add_argument(
        "--data",
        "--data-path",
        nargs="*",
        default=[],
        help="preprocessed dataset prefix, or pairs 'weight prefix' to blend (default: the built-in "
        "corpus tokenized in memory)",
    )
    p.add_argument("--valid-data", nargs="*", default=[], help="validation dataset prefix or blend (with --data)")
    p.add_argument(
        "--split",
        default=None,
        help="Megatron's: train,validation,test proportions carved from every --data dataset by document "
        "ranges, e.g. 969,30,1 (instead of --valid-data; the test part is unused)",
    )
    p.add_argument(
        "--tokenizer", default="bytes", help="bytes | a SentencePiece .model | a tokenizer.json | a folder holding one"
    )
    p.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="train on --data made with another tokenizer than --tokenizer (refused otherwise)",
    )
    p.add_argument(
        "--no-reset-at-documents", action="store_true", help="let the state run across packed documents (no seq_idx)"
    )
