"""Turning a plain module's full parameters into this rank's shards.

The tensor-parallel model is built the plain way first (every full tensor drawn exactly as the
single-device model draws it, on the same device, from the same random stream), then each
module is replaced by its parallel counterpart holding this rank's slices. So a TP model built
with a given seed has the single-device model's weights, at any TP size; the cost is one layer's
full tensors at a time. Values, dtype, device and the optimizer marks (`_no_weight_decay`,
`_no_reinit`) carry over; the parallel module's own initial draw is discarded and does not
touch the global random stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from megamamba.parallel.tensor.sharding import Component, Shard, full_key, local_shard, mark
from megamamba.parallel.tensor.tensor_parallel import TensorParallel

CARRIED_MARKS = ("_no_weight_decay", "_no_reinit")


def split_rows(full_name: str, size: int, component: str = "rows") -> Shard:
    """A tensor split evenly along dim 0 (heads, channels, vocabulary rows...)."""
    return Shard(full_name, 0, (Component(component, size),))


def _slice_of(full: nn.Parameter, shard: Shard | None, tp: TensorParallel) -> torch.Tensor:
    shard = shard or Shard(full_name="replicated", dim=None)
    return local_shard(full.detach(), shard, tp.size, tp.rank).to(device=full.device, dtype=full.dtype)


def _carry_marks(local: nn.Parameter, full: nn.Parameter) -> None:
    for name in CARRIED_MARKS:
        if hasattr(full, name):
            setattr(local, name, getattr(full, name))


def shard_parameter(full: nn.Parameter, shard: Shard, tp: TensorParallel) -> nn.Parameter:
    """A new marked parameter holding this rank's slice of `full`."""
    local = mark(nn.Parameter(_slice_of(full, shard, tp), requires_grad=full.requires_grad), shard)
    _carry_marks(local, full)
    return local


def sharded(full: nn.Module, build: Callable[[], nn.Module], tp: TensorParallel) -> nn.Module:
    """`build()`'s parallel module, holding this rank's shards of `full`'s parameters.

    Parameters pair by their full name (`weight_replicated` is part of `weight`): every full
    tensor must be used, every local one filled.
    """
    with torch.random.fork_rng(devices=[]):  # parallel layers draw on the CPU; keep the stream
        local = build()
    full_params: Mapping[str, nn.Parameter] = dict(full.named_parameters())
    used = set()
    for name, param in local.named_parameters():
        key = full_key(name, param)
        if key not in full_params:
            raise KeyError(f"parallel parameter {name} has no full tensor {key!r}; full: {sorted(full_params)}")
        values = _slice_of(full_params[key], getattr(param, "tp_shard", None), tp)
        if values.shape != param.shape:
            raise ValueError(
                f"{name}: this rank's slice of the full {key} has shape {tuple(values.shape)}, "
                f"the parallel parameter {tuple(param.shape)}"
            )
        param.data = values
        _carry_marks(param, full_params[key])
        used.add(key)
    unused = sorted(set(full_params) - used)
    if unused:
        raise KeyError(f"full tensors {unused} have no parallel parameter in {type(local).__name__}")
    return local
