"""The context-parallel group a layer works in: ranks holding consecutive slices of every sequence.

Rank r of a group of size C holds positions [r L/C, (r+1) L/C) of each sequence, of its input ids,
document ids (seq_idx, with ids that mean the same document on every rank) and labels, through
every layer. Layers receive a `ContextParallel` explicitly, as they receive a `TensorParallel`;
the collectives of `megamamba.parallel.tensor.collectives` read only its `group` and `size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamamba.errors import LayoutError
from megamamba.parallel.split import check_place
from megamamba.parallel.tensor.collectives import start_all_reduce


@dataclass(frozen=True)
class ContextParallel:
    """A rank's place in its context-parallel group; the default is one rank, no group."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    def __post_init__(self):
        check_place("context-parallel", self.group, self.size, self.rank)

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of this group's rank `group_rank` (for point-to-point sends)."""
        return dist.get_global_rank(self.group, group_rank)


def check_context_layout(
    seqlen: int, cp_size: int, d_conv: int, tp_size: int = 1, sequence_parallel: bool = False
) -> None:
    """Refuse a sequence length that `cp_size` ranks cannot split: equal slices (further split across
    TP with sequence parallelism), each at least the conv's d_conv - 1 tokens of history long."""
    if cp_size == 1:
        return
    parts = cp_size * tp_size if sequence_parallel else cp_size
    if seqlen % parts:
        what = f"CP {cp_size} x TP {tp_size} (sequence parallelism) = {parts}" if sequence_parallel else f"CP {cp_size}"
        raise LayoutError(
            f"context parallelism splits each sequence into equal slices: seqlen = {seqlen} is not divisible by {what}"
        )
    if seqlen // cp_size < d_conv - 1:
        raise LayoutError(
            f"context parallelism hands each rank's last d_conv - 1 = {d_conv - 1} tokens to the "
            f"next rank: slices of seqlen {seqlen} / CP {cp_size} = {seqlen // cp_size} are shorter"
        )


def sequence_window(seq_length: int, cp: ContextParallel) -> tuple[int, int]:
    """Positions [lo, hi) of a sequence that this rank holds: the data path reads only those."""
    if seq_length % cp.size:
        raise ValueError(
            f"context parallelism splits the sequence into {cp.size} equal slices: "
            f"seqlen = {seq_length} is not divisible by {cp.size}"
        )
    width = seq_length // cp.size
    return cp.rank * width, (cp.rank + 1) * width


def sequence_slice(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """This rank's consecutive slice of whole sequences `t` (batch, seqlen, ...)."""
    lo, hi = sequence_window(t.shape[1], cp)
    return t[:, lo:hi]


class _SumKeepingShare(torch.autograd.Function):
    """Forward: the sum of every rank's value over the CP group. Backward: each rank's gradient
    unchanged, for its own share of the sum."""

    @staticmethod
    def forward(ctx, x, cp):
        return start_all_reduce(x.clone(memory_format=torch.contiguous_format), cp).wait()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mean_over_context(local_mean: torch.Tensor, labels: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The mean over every counted token of the whole sequences from each rank's mean over its slice.

    `labels`: this rank's slice (-100 = not counted). Every rank gets the same value; the backward
    keeps each rank's share (its slice's sum / the total count), so gradients summed over the
    group are the gradients of the whole-sequence mean.
    """
    count = (labels != -100).sum().to(local_mean.dtype)
    total = start_all_reduce(count.clone(), cp).wait()
    # a slice without counted tokens (a masked prompt) has the mean 0 / 0: it adds nothing, not NaN
    local_sum = torch.where(count > 0, local_mean, torch.zeros_like(local_mean)) * count
    return _SumKeepingShare.apply(local_sum, cp) / total
