"""Packing one dataset's documents into fixed-length samples, with document ids per position.

Each epoch shuffles the documents and cuts their concatenation into samples of seq_length + 1
tokens; a document's segment begins at the end-of-document token before it, so it never sees the
document packed before it. With a vocab size, every id read is checked against it (a max and a min
per sample): a .bin changed after start-up fails here, naming the file and the token, on every rank
that reads it, rather than in the embedding (or silently, where a TP rank embeds only some rows).
Details: docs/data.md ("The data code").
"""

from collections import OrderedDict
from typing import Optional

import numpy as np

from megamamba.data.epoch_index import epoch_arrays, index_base
from megamamba.data.errors import DatasetError
from megamamba.data.indexed import IndexedDataset

_EPOCHS_CACHED = 2
_DOCUMENT_ORDER, _SAMPLE_ORDER = 0, 1


def segment_ids(document_ends: np.ndarray, length: int) -> np.ndarray:
    """int32 ids of `length` input positions from the window positions of documents' last tokens.

    The id steps up at every document's last token (its end-of-document token) and starts at 0.
    """
    steps = np.zeros(length, dtype=np.int32)
    ends = document_ends[(document_ends >= 0) & (document_ends < length)]
    np.add.at(steps, ends, 1)
    ids = np.cumsum(steps, dtype=np.int32)
    return ids - ids[0]


def _permutation(n: int, seed: int, key: int, epoch: int, purpose: int) -> np.ndarray:
    state = np.random.SeedSequence([seed, key, epoch, purpose]).generate_state(1)[0]
    return np.random.RandomState(state).permutation(n)


class DocumentPacker:
    """Sample number q of one dataset -> (tokens (seq_length + 1,) int64, document ids (seq_length,) int32)."""

    def __init__(self, dataset: IndexedDataset, seq_length: int, seed: int, key: int, vocab_size: Optional[int] = None):
        if seed < 0:
            raise ValueError(f"seed {seed}: must be >= 0")
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
        self.key = key
        self.vocab_size = vocab_size
        self.samples_per_epoch = (dataset.num_tokens - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"{dataset.prefix}: {dataset.num_tokens} tokens cannot fill one sample of "
                f"seq_length + 1 = {seq_length + 1} tokens"
            )
        self._epochs: OrderedDict = OrderedDict()

    def _epoch(self, epoch: int):
        """(document order, stream offset of each ordered document + the total, sample order) of an epoch."""
        if epoch not in self._epochs:
            documents = self.dataset.num_documents
            base = index_base(self.dataset, self.seed, self.key, self.seq_length, epoch)
            sizes = (documents, documents + 1, self.samples_per_epoch)
            self._epochs[epoch] = epoch_arrays(base, sizes, lambda: self._build_epoch(epoch))
            while len(self._epochs) > _EPOCHS_CACHED:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _build_epoch(self, epoch: int):
        order = _permutation(self.dataset.num_documents, self.seed, self.key, epoch, _DOCUMENT_ORDER)
        lengths = np.diff(self.dataset.offsets)[order]
        starts = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        samples = _permutation(self.samples_per_epoch, self.seed, self.key, epoch, _SAMPLE_ORDER)
        return order, starts, samples

    def sample(self, q: int, window: Optional[tuple[int, int]] = None) -> tuple[np.ndarray, np.ndarray]:
        """Sample q's tokens (seq_length + 1,) and document ids (seq_length,). With window (lo, hi),
        only input positions [lo, hi): tokens (hi - lo + 1,) and ids equal to the whole sample's
        ids[lo:hi] — a context-parallel rank reads its slice of the sequence alone."""
        lo, hi = (0, self.seq_length) if window is None else window
        if not 0 <= lo < hi <= self.seq_length:
            raise ValueError(f"window {window}: need 0 <= lo < hi <= seq_length {self.seq_length}")
        epoch, k = divmod(q, self.samples_per_epoch)
        order, starts, samples = self._epoch(epoch)
        sample_start = int(samples[k]) * self.seq_length
        begin, end = sample_start + lo, sample_start + hi + 1
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        stop = int(np.searchsorted(starts, end, side="left"))
        pieces, offsets = [], []  # the tokens of each document in the sample, and where they start in the .bin
        for d in range(first, stop):
            doc_start = self.dataset.offsets[order[d]]
            a, b = max(begin, starts[d]) - starts[d], min(end, starts[d + 1]) - starts[d]
            pieces.append(self.dataset.tokens[doc_start + a : doc_start + b])
            offsets.append(int(doc_start + a))
        tokens = np.concatenate(pieces).astype(np.int64)
        if self.vocab_size is not None and (tokens.max() >= self.vocab_size or tokens.min() < 0):
            positions = np.concatenate([np.arange(o, o + p.size) for o, p in zip(offsets, pieces)])
            raise self._outside_vocabulary(tokens, positions)
        ids = segment_ids(starts[first + 1 : stop + 1] - 1 - begin, hi - lo)
        # the whole sample's ids step up at each document end at positions 1..lo: its ends before the window
        ids += np.int32(
            np.searchsorted(starts, begin + 1, side="right") - np.searchsorted(starts, sample_start + 2, side="left")
        )
        return tokens, ids

    def _outside_vocabulary(self, tokens: np.ndarray, positions: np.ndarray) -> DatasetError:
        """The error naming the first of `tokens` outside [0, vocab_size) and where it is (`positions`: in the
        dataset's tokens)."""
        first = int(np.flatnonzero((tokens >= self.vocab_size) | (tokens < 0))[0])
        return DatasetError(
            f"{self.dataset.locate(int(positions[first]))}: token id {tokens[first]} is outside the vocabulary of "
            f"{self.vocab_size} ids: the file changed after start-up checked it; restore it or re-run "
            "python -m megamamba.data.preprocess, then resume"
        )
