"""A rank's part of a parameter's full, layout-free tensor: its tensor-parallel rows or its experts."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megamamba.parallel.expert.expert_parallel import local_experts
from megamamba.parallel.tensor.sharding import local_shard
from megamamba.parallel.tensor.tensor_parallel import TensorParallel


def local_part(full: torch.Tensor, param: nn.Parameter, tp: Optional[TensorParallel]) -> torch.Tensor:
    """`full` cut to what `param` holds on this rank: its `tp_shard` under `tp`, its `expert_shard` (no
    communication); `full` itself for a parameter held whole."""
    shard, experts = getattr(param, "tp_shard", None), getattr(param, "expert_shard", None)
    if tp is not None and shard is not None:
        return local_shard(full, shard, tp.size, tp.rank)
    if experts is not None and experts.split:
        return local_experts(full, experts)
    return full
