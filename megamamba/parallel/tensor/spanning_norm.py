"""Mamba-2's gated RMSNorm followed by out_proj when a norm group spans several TP ranks.

The RMS is one scalar per token and group, so it commutes with the row-parallel out_proj:

    out_proj(norm(u)) = sum_g  rsqrt(mean_g(u^2) + eps) * sum_{ranks r of g} W_r (w_r * u_r)

The mean squares travel in float32 beside out_proj's reduction. Why, and the memory: docs/code.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamamba.parallel.tensor.collectives import (
    copy_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from megamamba.parallel.tensor.layers import RowParallelLinear


def _in_float(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor):
    """y, z and the weight in float32 (or wider), and the gate silu(z)."""
    ct = torch.promote_types(y.dtype, torch.float32)
    zf = z.to(ct)
    return y.to(ct), zf, F.silu(zf), weight.to(ct)


class _GatedScale(torch.autograd.Function):
    """(y, z, weight) -> (u * weight in y's dtype, gated after the weighting if the norm comes before
    the gate; this rank's share of each token's mean square of u over its group, float32), where u is
    y gated by silu(z) unless the norm comes before the gate.

    Saves y, z and the weight as they come; the float32 intermediates are recomputed backward.
    """

    @staticmethod
    def forward(ctx, y, z, weight, group_size: int, norm_before_gate: bool):
        ctx.save_for_backward(y, z, weight)
        ctx.group_size, ctx.norm_before_gate = group_size, norm_before_gate
        yf, _, gate, w = _in_float(y, z, weight)
        u = yf if norm_before_gate else yf * gate
        scaled = u * w
        if norm_before_gate:
            scaled = scaled * gate
        return scaled.to(y.dtype), u.pow(2).sum(-1, keepdim=True) / group_size

    @staticmethod
    def backward(ctx, grad_scaled, grad_mean_square):
        y, z, weight = ctx.saved_tensors
        yf, zf, gate, w = _in_float(y, z, weight)
        u = yf if ctx.norm_before_gate else yf * gate
        grad = grad_scaled.to(u.dtype)
        if ctx.norm_before_gate:  # scaled = (u * w) * gate
            grad_gate, grad = grad * (u * w), grad * gate
        grad_w = (grad * u).sum_to_size(w.shape)
        grad_u = grad * w + grad_mean_square / ctx.group_size * (2 * u)
        if not ctx.norm_before_gate:  # u = y * gate
            grad_gate, grad_u = grad_u * yf, grad_u * gate
        grad_z = torch.ops.aten.silu_backward(grad_gate, zf)
        return grad_u.to(y.dtype), grad_z.to(z.dtype), grad_w.to(weight.dtype), None, None


def gated_rmsnorm_row_parallel(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    group_size: int,
    ngroups: int,
    norm_before_gate: bool,
    out_proj: RowParallelLinear,
) -> torch.Tensor:
    """out_proj(rmsnorm_gated(y, norm_weight, z=z, group_size=group_size)) over the TP group.

    y, z: (batch, seqlen, local channels), this rank's channels, all in group
    `tp.rank // (tp.size // ngroups)`. Returns out_proj's output: replicated, or with
    sequence parallelism this rank's sequence shard. Computed in float32 like the norm kernel.
    """
    tp = out_proj.tp
    if tp.size % ngroups:
        raise ValueError(f"a norm group spanning ranks needs ngroups = {ngroups} dividing the TP size {tp.size}")
    group = tp.rank // (tp.size // ngroups)
    scaled, mean_square = _GatedScale.apply(y, z, norm_weight, group_size, norm_before_gate)
    partial = F.linear(scaled, out_proj.weight)
    reduce = reduce_scatter_to_sequence_region if tp.sequence_parallel else reduce_from_tp_region

    def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:  # (..., n) -> (..., ngroups, n), group slots summed
        slots = torch.stack([t if g == group else torch.zeros_like(t) for g in range(ngroups)], dim=-2)
        return reduce(slots.flatten(-2), tp).unflatten(-1, slots.shape[-2:])

    products, mean_squares = summed_over_ranks(partial), summed_over_ranks(mean_square)
    out = (products * torch.rsqrt(mean_squares + eps).to(products.dtype)).sum(-2)
    if out_proj.bias is None:
        return out
    return out + (copy_to_tp_region(out_proj.bias, tp) if tp.sequence_parallel else out_proj.bias)
