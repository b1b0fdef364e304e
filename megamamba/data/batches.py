"""The training data path: blended, packed global batches that do not depend on the parallel layout.

Global sample j (numbered across steps: j = step * global_batch_size + row) comes from the
dataset and sample number the `BlendSchedule` assigns, packed by that dataset's
`DocumentPacker`. So a step's global batch depends only on (seed, step, data, seq_length,
global_batch_size). Data-parallel rank r of d takes the contiguous rows [r*G/d, (r+1)*G/d)
and cuts them into micro-batches in order: the concatenation over ranks is the global batch
for any (dp, tp, pp), and a run restarted at step s reads exactly what an uninterrupted run
would, computing nothing for the steps before s.

Every batch is (inputs, labels, seq_idx): int64 (rows, seq_length) ids and next-token labels,
and int32 (rows, seq_length) document ids for the model's `seq_idx` (state reset at document
boundaries, see packing.py), or None when `reset_at_documents` is off.
"""
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from megamamba.data.blend import BlendSchedule, parse_blend
from megamamba.data.indexed import IndexedDataset
from megamamba.data.packing import DocumentPacker

Batch = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def open_blend(data: Sequence[str], vocab_size: Optional[int] = None) -> tuple[list[IndexedDataset], list]:
    """`--data` values ("prefix" or "w1 prefix1 w2 prefix2 ...") -> (datasets, normalised weights).

    With vocab_size, every dataset is checked to hold only ids below it.
    """
    blend = parse_blend(data)
    return [IndexedDataset(prefix, vocab_size) for _, prefix in blend], [w for w, _ in blend]


class PackedGlobalBatches:
    """Step -> global batch of packed samples from weighted datasets (see the module docstring)."""

    def __init__(self, datasets: Sequence[IndexedDataset], weights: Sequence, seq_length: int,
                 global_batch_size: int, seed: int, reset_at_documents: bool = True):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        for name, value in (("seq_length", seq_length), ("global_batch_size", global_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        self.schedule = BlendSchedule(weights)
        self.packers = [DocumentPacker(d, seq_length, seed, key) for key, d in enumerate(datasets)]
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.reset_at_documents = reset_at_documents

    def sources(self, step: int, first: int, stop: int) -> list[tuple[int, int]]:
        """(dataset index, sample number in it) of rows [first, stop) of the step's global batch."""
        if step < 0 or not 0 <= first <= stop <= self.global_batch_size:
            raise ValueError(f"rows [{first}, {stop}) of step {step}: need step >= 0 and "
                             f"0 <= first <= stop <= {self.global_batch_size}")
        base = step * self.global_batch_size
        return self.schedule.assign(base + first, base + stop)

    def rows(self, step: int, first: int, stop: int) -> Batch:
        """Rows [first, stop) of the global batch of `step`."""
        samples = [self.packers[i].sample(q) for i, q in self.sources(step, first, stop)]
        tokens = torch.from_numpy(np.stack([t for t, _ in samples]))
        seq_idx = torch.from_numpy(np.stack([s for _, s in samples])) if self.reset_at_documents else None
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), seq_idx

    def global_batch(self, step: int) -> Batch:
        return self.rows(step, 0, self.global_batch_size)

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[Batch]:
        """This data-parallel rank's contiguous slice of the step's global batch, as consecutive micro-batches."""
        per_rank = self.global_batch_size // dp_size
        if per_rank * dp_size != self.global_batch_size or per_rank % micro_batch_size:
            raise ValueError(f"global batch {self.global_batch_size} does not split into {dp_size} data-parallel "
                             f"ranks of whole micro-batches of {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank}: must lie in [0, {dp_size})")
        first = dp_rank * per_rank
        return [self.rows(step, m, m + micro_batch_size) for m in range(first, first + per_rank, micro_batch_size)]

    def iterate(self, start_step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> Iterator[Batch]:
        """Micro-batches of steps start_step, start_step + 1, ... in order, without end."""
        step = start_step
        while True:
            yield from self.micro_batches(step, dp_rank, dp_size, micro_batch_size)
            step += 1
