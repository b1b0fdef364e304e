"""The column-parallel matmul with its input collective fused in, so backward can overlap it.

    parallel_linear(x, weight, bias, tp) = x_total @ weight.T + bias

A sequence-parallel `x` is all-gathered while this rank's own tokens are multiplied; backward
computes the weight gradient while the input gradient's collective travels. More: docs/code.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamamba.parallel.tensor.collectives import start_all_gather, start_all_reduce, start_reduce_scatter
from megamamba.parallel.tensor.tensor_parallel import SEQ_DIM, TensorParallel


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _gather_overlapped(x, weight, bias, tp):
    """(all-gathered x, its product): this rank's tokens are multiplied while the others arrive."""
    pending = start_all_gather(x, tp, SEQ_DIM)
    own = F.linear(x, weight, bias)
    total = pending.wait()
    parts = total.chunk(tp.size, SEQ_DIM)
    out = torch.cat([own if r == tp.rank else F.linear(part, weight, bias) for r, part in enumerate(parts)], SEQ_DIM)
    return total, out


class _ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        dtype = _autocast_dtype(x)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            if tp.sequence_parallel:
                total, out = _gather_overlapped(x, weight, bias, tp)
            else:
                total, out = x, F.linear(x, weight, bias)
        ctx.save_for_backward(total, weight)
        ctx.tp = tp
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        tp = ctx.tp
        grad = grad.to(weight.dtype)
        pending = None
        if ctx.needs_input_grad[0]:
            grad_total = grad.matmul(weight)
            pending = (
                start_reduce_scatter(grad_total, tp, SEQ_DIM)
                if tp.sequence_parallel
                else start_all_reduce(grad_total, tp)
            )
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = pending.wait() if pending is not None else None
        return grad_x, grad_weight, grad_bias, None


def parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel
) -> torch.Tensor:
    """This rank's output features of x @ weight.T + bias (see the module docstring)."""
    return _ParallelLinear.apply(x, weight, bias, tp)
