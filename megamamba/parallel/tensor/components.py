"""Parameters whose full tensor is a concatenation of components, each split on its own.

Mamba-2's in_proj rows are [z, x, B, C, dt] and its conv channels [x, B, C]: every rank holds
its slice of each sharded component, so the full tensor is the same at every TP size. A
component may be replicated instead (B, C when ngroups < TP): it lives whole in a second
parameter whose gradient is all-reduced over TP, because each rank uses it differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megamamba.parallel.tensor.collectives import copy_to_tp_region
from megamamba.parallel.tensor.sharding import Component, Shard, mark
from megamamba.parallel.tensor.tensor_parallel import TensorParallel


def component_parameters(
    full_shape: Sequence[int],
    dim: int,
    components: Sequence[Component],
    tp: TensorParallel,
    full_name: str,
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """Empty, marked local parameters for the full tensor `full_name` of `full_shape`.

    The first holds this rank's slice of every sharded component (in order); the second, None
    when every component is sharded, holds the replicated components whole.
    """
    components = tuple(components)
    if sum(c.size for c in components) != full_shape[dim]:
        raise ValueError(
            f"{full_name}: components {[(c.name, c.size) for c in components]} do not sum to "
            f"dim {dim} of the full shape {tuple(full_shape)}"
        )
    if not any(c.sharded for c in components):
        raise ValueError(f"{full_name}: at least one component must be sharded, got {components}")
    shard = Shard(full_name, dim, components)
    shape = list(full_shape)
    shape[dim] = sum(shard.local_sizes(tp.size))
    sharded = mark(nn.Parameter(torch.empty(shape)), shard)
    replicated_rows = sum(c.size for c in components if not c.sharded)
    if not replicated_rows:
        return sharded, None
    shape[dim] = replicated_rows
    rep_shard = Shard(full_name, dim, components, replicated_part=True, grad_reduced=True)
    return sharded, mark(nn.Parameter(torch.empty(shape)), rep_shard)


def in_component_order(
    sharded: torch.Tensor,
    replicated: torch.Tensor | None,
    components: Sequence[Component],
    tp: TensorParallel,
    dim: int = 0,
) -> torch.Tensor:
    """This rank's tensor along `dim` in component order: its slice of each sharded component,
    the replicated ones whole (entering through `copy_to_tp_region`, so their gradient is summed
    over TP). Without replicated components, `sharded` itself."""
    if replicated is None:
        return sharded
    replicated = copy_to_tp_region(replicated, tp)
    own = iter(sharded.split([c.size // tp.size for c in components if c.sharded], dim))
    rep = iter(replicated.split([c.size for c in components if not c.sharded], dim))
    return torch.cat([next(own) if c.sharded else next(rep) for c in components], dim)
