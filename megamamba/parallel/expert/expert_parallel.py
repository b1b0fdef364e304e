"""The expert-parallel group a mixture-of-experts layer works in: ranks of the data x context axis that each hold
a contiguous share of every layer's experts and compute them for the tokens of the whole group.

Rank r of a group of size P holds experts [r E/P, (r+1) E/P) of E. The ranks holding the same experts (one per
expert-parallel group) form its expert-data-parallel group, over which those experts' gradients are reduced.
The default is one rank, no group: every layer holds all its experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megamamba.errors import LayoutError
from megamamba.parallel.split import check_place


@dataclass(frozen=True)
class ExpertParallel:
    """A rank's place in its expert-parallel group."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    def __post_init__(self):
        check_place("expert-parallel", self.group, self.size, self.rank)

    def experts_here(self, num_experts: int) -> range:
        """The experts of `num_experts` this rank holds."""
        check_expert_layout(num_experts, self.size)
        share = num_experts // self.size
        return range(self.rank * share, (self.rank + 1) * share)


@dataclass(frozen=True)
class ExpertShard:
    """What a parameter of stacked experts holds along dim 0: experts [first, first + count) of `num_experts`
    (the attribute `expert_shard` that checkpoints, initial states and the engine read)."""

    num_experts: int
    first: int
    count: int

    @property
    def split(self) -> bool:
        """True when other ranks hold the other experts."""
        return self.count < self.num_experts

    @property
    def rows(self) -> tuple:
        """The full tensor's range of rows along dim 0 this parameter holds."""
        return ((self.first, self.first + self.count),)


def mark_experts(param, num_experts: int, here: range):
    """Attach `expert_shard` to a parameter holding the experts `here` of `num_experts`, stacked along dim 0."""
    param.expert_shard = ExpertShard(num_experts, here.start, len(here))
    return param


def holds_split_experts(param) -> bool:
    """Whether `param` holds a share of its layer's experts, the other ranks of its expert group the rest."""
    shard = getattr(param, "expert_shard", None)
    return shard is not None and shard.split


def local_experts(full, shard: ExpertShard):
    """This rank's experts cut from the full stacked tensor (no communication)."""
    if full.shape[0] != shard.num_experts:
        raise ValueError(f"a full tensor of {shard.num_experts} stacked experts has {full.shape[0]} along dim 0")
    return full[shard.first : shard.first + shard.count]


def check_expert_layout(num_experts: int, ep_size: int, data_axis_size: int | None = None) -> None:
    """Refuse (LayoutError) an expert-parallel size that does not divide the experts, or, given, the data x context
    ranks it is carved from."""
    if num_experts % ep_size:
        raise LayoutError(
            f"--expert-model-parallel-size {ep_size} does not divide moe_cfg.num_experts = {num_experts}: every "
            "expert-parallel rank holds the same number of experts"
        )
    if data_axis_size is not None and data_axis_size % ep_size:
        raise LayoutError(
            f"--expert-model-parallel-size {ep_size} does not divide the data x context-parallel ranks "
            f"({data_axis_size}) it is carved from: choose a divisor of dp x cp"
        )
