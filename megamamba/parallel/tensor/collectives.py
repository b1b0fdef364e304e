"""Tensor-parallel collectives: raw counted operations and Megatron-style autograd regions.

Raw operations are asynchronous and return a `Pending`; each records itself in `comm_counter`.
At TP size 1 every one is the identity and nothing is counted. The regions' forward and backward:
docs/code.md ("Tensor and sequence parallelism").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megamamba.parallel.comm_counter import comm_counter
from megamamba.parallel.tensor.tensor_parallel import SEQ_DIM, TensorParallel


def _all_gather_single(*args, **kwargs):
    """torch 2.13's all_gather_single, else all_gather_into_tensor (torch 2.11), found per call."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    """torch 2.13's reduce_scatter_single, else reduce_scatter_tensor (torch 2.11), found per call."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class Pending:
    """A collective in flight; `wait()` blocks until it is done and returns its result."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish()


def _check_divisible(x: torch.Tensor, dim: int, tp: TensorParallel) -> None:
    if x.shape[dim] % tp.size:
        what = "seqlen" if dim == SEQ_DIM else f"dim {dim}"
        raise ValueError(
            f"splitting across the tensor-parallel group needs {what} = {x.shape[dim]} "
            f"divisible by the TP size {tp.size} (tensor shape {tuple(x.shape)})"
        )


class RankGroup(Protocol):
    """What a raw collective reads of its group: a TensorParallel, ContextParallel or ExpertParallel."""

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def size(self) -> int: ...


def start_all_reduce(x: torch.Tensor, tp: RankGroup, op: str = "sum") -> Pending:
    """All-reduce `x` IN PLACE over the group (TP, or another: `RankGroup`; `op` is "sum" or "max"); x must be
    contiguous."""
    if tp.size == 1:
        return Pending(None, lambda: x)
    if not x.is_contiguous():
        raise ValueError(f"in-place all-reduce needs a contiguous tensor, got strides {x.stride()}")
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    comm_counter.record("all_reduce" if op == "sum" else "all_reduce_max", x.nbytes, tp.size)
    work = dist.all_reduce(x, op=reduce_op, group=tp.group, async_op=True)
    return Pending(work, lambda: x)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def start_all_gather(x: torch.Tensor, tp: TensorParallel, dim: int) -> Pending:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if tp.size == 1:
        return Pending(None, lambda: x)
    dim = dim % x.dim()
    flat = x.new_empty((tp.size * x.shape[0], *x.shape[1:]))  # rank blocks along dim 0, as gloo wants
    comm_counter.record("all_gather", flat.nbytes, tp.size)
    work = _all_gather_single(flat, x.contiguous(), group=tp.group, async_op=True)
    return Pending(work, lambda: flat.view(tp.size, *x.shape).movedim(0, dim).flatten(dim, dim + 1))


def start_reduce_scatter(x: torch.Tensor, tp: TensorParallel, dim: int) -> Pending:
    """Sum `x` over the group and keep this rank's slice of the sum along `dim`."""
    if tp.size == 1:
        return Pending(None, lambda: x)
    dim = dim % x.dim()
    _check_divisible(x, dim, tp)
    stacked = x.unflatten(dim, (tp.size, x.shape[dim] // tp.size)).movedim(dim, 0).contiguous()
    out = x.new_empty(stacked.shape[1:])
    comm_counter.record("reduce_scatter", x.nbytes, tp.size)
    work = _reduce_scatter_single(out, stacked.flatten(0, 1), group=tp.group, async_op=True)
    return Pending(work, lambda: out)


def split_along(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim` (no communication)."""
    if tp.size == 1:
        return x
    _check_divisible(x, dim, tp)
    return x.chunk(tp.size, dim)[tp.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return start_all_reduce(_fresh(grad), ctx.tp).wait(), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return start_all_reduce(_fresh(x), tp).wait()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return start_all_gather(x, tp, -1).wait()

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.tp, -1), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_along(x, tp, -1)

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad, ctx.tp, -1).wait(), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return start_all_gather(x, tp, SEQ_DIM).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_reduce_scatter(grad, ctx.tp, SEQ_DIM).wait(), None


class _GatherWholeSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return start_all_gather(x, tp, SEQ_DIM).wait()

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.tp, SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return start_reduce_scatter(x, tp, SEQ_DIM).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad, ctx.tp, SEQ_DIM).wait(), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_along(x, tp, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad, ctx.tp, SEQ_DIM).wait(), None


def copy_to_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Enter rank-specific compute with a replicated tensor: its gradient is summed over TP."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum partial results over TP; the result feeds replicated compute."""
    return x if tp.size == 1 else _ReduceFromRegion.apply(x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate the ranks' last-dim slices; the result feeds replicated compute."""
    return x if tp.size == 1 else _GatherFromRegion.apply(x, tp)


def scatter_to_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Keep this rank's last-dim slice of a replicated tensor."""
    return x if tp.size == 1 else _ScatterToRegion.apply(x, tp)


def gather_from_sequence_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sequence-parallel shards -> the whole sequence, for rank-specific compute."""
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp)


def gather_whole_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sequence-parallel shards -> the whole sequence, for compute every rank repeats alike: the gradient of this
    rank's shard is its slice of the whole sequence's (the same on every rank), not a sum over the ranks."""
    return x if tp.size == 1 else _GatherWholeSequence.apply(x, tp)


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Partial results over the whole sequence -> this rank's summed sequence shard."""
    return x if tp.size == 1 else _ReduceScatterToSequence.apply(x, tp)


def scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A replicated tensor -> this rank's sequence shard."""
    return x if tp.size == 1 else _ScatterToSequence.apply(x, tp)


class _FinishSequenceGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending, tp):
        ctx.tp = tp
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        return start_reduce_scatter(grad, ctx.tp, SEQ_DIM).wait(), None, None


class SequenceGather:
    """An all-gather along the sequence already in flight (see `start_sequence_gather`)."""

    def __init__(self, x: torch.Tensor, tp: TensorParallel):
        self._x = x
        self._tp = tp
        self._pending = start_all_gather(x.detach(), tp, SEQ_DIM) if tp.size > 1 else None

    def wait(self) -> torch.Tensor:
        """The whole sequence, differentiable: its gradient is reduce-scattered back."""
        if self._pending is None:
            return self._x
        return _FinishSequenceGather.apply(self._x, self._pending, self._tp)


def start_sequence_gather(x: torch.Tensor, tp: TensorParallel) -> SequenceGather:
    """Start `gather_from_sequence_region(x, tp)` now and finish it at `.wait()`.

    Work done between the two calls overlaps the communication.
    """
    return SequenceGather(x, tp)
