"""Mamba-2's gated RMSNorm followed by out_proj when a norm group spans several TP ranks.

The norm divides each group of `group_size = d_inner / ngroups` channels by its RMS. When
ngroups < TP (every published Mamba-2 has ngroups = 1) a group spans TP / ngroups ranks, so no
rank can normalise alone. The RMS is one scalar per token and group, so it commutes with the
row-parallel out_proj:

    out_proj(norm(u)) = sum_g  rsqrt(mean_g(u^2) + eps) * sum_{ranks r of g} W_r (w_r * u_r)

Each rank reduces its partial products (in the activations' dtype, as out_proj's reduction
would) and, beside them, its share of each group's mean square in float32: one scalar per token
and group, so the statistics cost a small second reduction (none backward without sequence
parallelism; with it, a small all-gather) and keep the norm's scale exact under bf16 autocast,
where rounding them to bf16 before the sum was off by about 0.4%. For ngroups > 1 each rank fills
only its group's slot, so the reductions carry ngroups partial results.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamamba.parallel.collectives import copy_to_tp_region, reduce_from_tp_region, reduce_scatter_to_sequence_region
from megamamba.parallel.layers import RowParallelLinear


def gated_rmsnorm_row_parallel(
    y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, group_size: int, ngroups: int,
    norm_before_gate: bool, out_proj: RowParallelLinear,
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
    ct = torch.promote_types(y.dtype, torch.float32)
    u, gate = y.to(ct), F.silu(z.to(ct))
    if not norm_before_gate:
        u = u * gate
    scaled = u * norm_weight.to(ct)
    if norm_before_gate:
        scaled = scaled * gate
    partial = F.linear(scaled.to(y.dtype), out_proj.weight)
    mean_square = u.pow(2).sum(-1, keepdim=True) / group_size  # this rank's share of its group's, float32
    reduce = reduce_scatter_to_sequence_region if tp.sequence_parallel else reduce_from_tp_region

    def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:  # (..., n) -> (..., ngroups, n), group slots summed
        slots = torch.stack([t if g == group else torch.zeros_like(t) for g in range(ngroups)], dim=-2)
        return reduce(slots.flatten(-2), tp).unflatten(-1, slots.shape[-2:])

    products, mean_squares = summed_over_ranks(partial), summed_over_ranks(mean_square)
    out = (products * torch.rsqrt(mean_squares + eps).to(products.dtype)).sum(-2)
    if out_proj.bias is None:
        return out
    return out + (copy_to_tp_region(out_proj.bias, tp) if tp.sequence_parallel else out_proj.bias)
