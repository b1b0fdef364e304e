"""The causal conv's halo: the previous rank's last d_conv - 1 tokens, and their gradient sent back.

A depthwise causal conv of width w reads w - 1 tokens before each position, so the first w - 1
outputs of a context-parallel slice need the end of the previous rank's slice. Each rank sends
its last w - 1 tokens forward (rank 0 receives zeros, which is the conv's own zero padding) and,
in the backward, the halo's gradient back to the rank that owns those tokens. With packed
documents the previous rank's last document ids travel too, so taps across a document change
(including one exactly at the rank edge) are masked as on one device. Every send is counted
(`comm_counter`, kind "send", the bytes sent).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megamamba.kernels import causal_conv1d
from megamamba.parallel.comm_counter import comm_counter
from megamamba.parallel.context.context_parallel import ContextParallel


def shift_along_ranks(x: torch.Tensor, cp: ContextParallel, step: int) -> torch.Tensor:
    """Send `x` to rank + step and return what rank - step sent (zeros where no such rank)."""
    x = x.contiguous()
    received = torch.zeros_like(x)
    works = []
    if 0 <= cp.rank + step < cp.size:
        comm_counter.record("send", x.nbytes, cp.size)
        works.append(dist.isend(x, cp.global_rank(cp.rank + step), group=cp.group))
    if 0 <= cp.rank - step < cp.size:
        works.append(dist.irecv(received, cp.global_rank(cp.rank - step), group=cp.group))
    for work in works:
        work.wait()
    return received


class _PreviousHalo(torch.autograd.Function):
    """tail (batch, channels, w - 1) of every rank -> the previous rank's tail; gradients flow back."""

    @staticmethod
    def forward(ctx, tail, cp):
        ctx.cp = cp
        return shift_along_ranks(tail, cp, 1)

    @staticmethod
    def backward(ctx, grad):
        return shift_along_ranks(grad, ctx.cp, -1), None


def from_previous_rank(tail: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The previous rank's `tail` (zeros on rank 0); its gradient goes back to that rank in the backward."""
    return _PreviousHalo.apply(tail, cp)


def previous_ids(seq_idx: torch.Tensor, count: int, cp: ContextParallel) -> torch.Tensor:
    """The previous rank's last `count` document ids (batch, count); zeros on rank 0."""
    if seq_idx.shape[1] < count:
        raise ValueError(
            f"a context-parallel slice of {seq_idx.shape[1]} tokens is shorter than the "
            f"{count} tokens of document history the next rank needs"
        )
    return shift_along_ranks(seq_idx[:, -count:], cp, 1)


def causal_conv1d_with_halo(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cp: ContextParallel,
    seq_idx: torch.Tensor | None = None,
    halo_ids: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """`causal_conv1d` of this rank's slice x (batch, dim, seqlen) as part of the whole sequence.

    seq_idx: this slice's document ids; halo_ids: the previous rank's last w - 1 ids
    (`previous_ids`), needed with seq_idx.
    """
    halo = weight.shape[1] - 1
    if halo == 0:
        return causal_conv1d(x, weight, bias, seq_idx=seq_idx, activation=activation)
    if x.shape[-1] < halo:
        raise ValueError(
            f"a context-parallel slice of {x.shape[-1]} tokens is shorter than the conv's "
            f"halo of {halo} tokens (d_conv - 1)"
        )
    received = _PreviousHalo.apply(x[..., -halo:], cp)
    ids = None if seq_idx is None else torch.cat([halo_ids[:, -halo:], seq_idx], dim=-1)
    return checkpoint(_conv_after_halo, received, x, weight, bias, ids, activation, use_reentrant=False)


def _conv_after_halo(received, x, weight, bias, ids, activation):
    """The conv of [received, x] at x's positions. Run under `checkpoint`: backward keeps x, not a
    copy of it with the halo in front."""
    extended = torch.cat([received, x], dim=-1)
    return causal_conv1d(extended, weight, bias, seq_idx=ids, activation=activation)[..., received.shape[-1] :]
