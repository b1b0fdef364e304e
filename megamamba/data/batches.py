"""The training data path: blended, packed global batches that do not depend on the parallel layout.

Addressed by global sample number, so the samples depend only on (seed, data, seq_length), and a
resume at any global batch size reads what an uninterrupted run would. Details: docs/data.md.
"""

import hashlib
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np
import torch

from megamamba.data.blend import BlendSchedule, parse_blend
from megamamba.data.indexed import IndexedDataset
from megamamba.data.packing import DocumentPacker

Batch = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def open_blend(data: Sequence[str], vocab_size: Optional[int] = None) -> tuple[list[IndexedDataset], list]:
    """`--data` values ("prefix" or "w1 prefix1 w2 prefix2 ...") -> (datasets, normalised weights).

    With vocab_size, every dataset's content is checked against its recorded checksum and to hold only
    ids below it (each dataset's `warning` says where that check has a reservation).
    """
    blend = parse_blend(data)
    return [IndexedDataset(prefix, vocab_size) for _, prefix in blend], [w for w, _ in blend]


def fingerprint(dataset, samples: int = 1024) -> str:
    """sha256 of up to `samples` evenly spaced document offsets and the first token of each document there.

    Constant cost at any dataset size; re-preprocessing that moves a sampled document boundary or
    changes a sampled document's first token changes it.
    """
    count = min(samples, dataset.num_documents)
    picks = np.unique(np.linspace(0, dataset.num_documents - 1, num=count).astype(np.int64))
    starts = np.asarray(dataset.offsets[picks], dtype="<i8")
    digest = hashlib.sha256(starts.tobytes())
    digest.update(np.asarray(dataset.tokens[starts], dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()


class PackedGlobalBatches:
    """Global sample numbers -> packed batches from weighted datasets (see the module docstring); with
    `vocab_size`, every id read is checked to lie in [0, vocab_size) (packing.py)."""

    def __init__(
        self,
        datasets: Sequence[IndexedDataset],
        weights: Sequence,
        seq_length: int,
        global_batch_size: int,
        seed: int,
        reset_at_documents: bool = True,
        vocab_size: Optional[int] = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        for name, value in (("seq_length", seq_length), ("global_batch_size", global_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        self.datasets, self.weights, self.seed = list(datasets), [Fraction(w) for w in weights], seed
        self.schedule = BlendSchedule(weights)
        self.packers = [DocumentPacker(d, seq_length, seed, key, vocab_size) for key, d in enumerate(datasets)]
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.reset_at_documents = reset_at_documents

    def identity(self) -> list[dict]:
        """The blend as a checkpoint records it: per dataset its weight, prefix, documents, tokens and fingerprint."""
        return [
            {
                "weight": str(w),
                "prefix": d.prefix,
                "documents": d.num_documents,
                "tokens": d.num_tokens,
                "fingerprint": fingerprint(d),
            }
            for w, d in zip(self.weights, self.datasets)
        ]

    def sources_at(self, first: int, stop: int) -> list[tuple[int, int]]:
        """(dataset index, sample number in it) of global samples [first, stop)."""
        if not 0 <= first <= stop:
            raise ValueError(f"global samples [{first}, {stop}): need 0 <= first <= stop")
        return self.schedule.assign(first, stop)

    def _pack(self, sources: list[tuple[int, int]], window: Optional[tuple[int, int]] = None) -> Batch:
        samples = [self.packers[i].sample(q, window) for i, q in sources]
        tokens = torch.from_numpy(np.stack([t for t, _ in samples]))
        seq_idx = torch.from_numpy(np.stack([s for _, s in samples])) if self.reset_at_documents else None
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), seq_idx

    def rows_at(self, first: int, stop: int, window: Optional[tuple[int, int]] = None) -> Batch:
        """Global samples [first, stop) as rows; with window (lo, hi) only sequence positions [lo, hi)."""
        return self._pack(self.sources_at(first, stop), window)

    def micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int, window: Optional[tuple[int, int]] = None
    ) -> list[Batch]:
        """This data-parallel rank's contiguous slice of the step's global batch, as consecutive micro-batches
        (at one global batch size for the whole stream, as validation reads its own)."""
        if step < 0:
            raise ValueError(f"step {step}: must be >= 0")
        return self.micro_batches_at(step * self.global_batch_size, dp_rank, dp_size, micro_batch_size, window)

    def micro_batches_at(
        self,
        first_sample: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        window: Optional[tuple[int, int]] = None,
    ) -> list[Batch]:
        """This data-parallel rank's slice of the global batch starting at global sample `first_sample`
        (with window (lo, hi), a context-parallel rank's positions [lo, hi) of its sequences)."""
        per_rank = self.global_batch_size // dp_size
        if per_rank * dp_size != self.global_batch_size or per_rank % micro_batch_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into {dp_size} data-parallel "
                f"ranks of whole micro-batches of {micro_batch_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank}: must lie in [0, {dp_size})")
        first = first_sample + dp_rank * per_rank
        return [self.rows_at(m, m + micro_batch_size, window) for m in range(first, first + per_rank, micro_batch_size)]
