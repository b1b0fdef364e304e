"""Dispatch of a mixture-of-experts block: the tokens' copies sorted by expert for the grouped experts, and the
experts' outputs combined back per token with the routing weights.

The sorted rows and the rows per expert are all the experts need, so that expert parallelism can send each
rank its experts' rows (an all-to-all with these counts) between `permute` and the experts, and back before
`combine`. With a capacity, an expert keeps its capacity of rows with the largest weights (Megatron's "probs"
policy); the rest are dropped.
"""

import math
from typing import NamedTuple, Optional

import torch


class Dispatch(NamedTuple):
    """`slots` (rows,): the (token, choice) slot, token * top_k + choice, each row of the sorted order copies,
    by expert and within an expert by token (by weight, largest first, under a capacity); `tokens_per_expert`
    (num_experts,) int64: the rows of each expert, in expert order; `top_k`."""

    slots: torch.Tensor
    tokens_per_expert: torch.Tensor
    top_k: int


def capacity_of(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows one expert keeps: capacity_factor x its share of the tokens' top_k copies, rounded up."""
    return math.ceil(tokens * top_k / num_experts * capacity_factor)


def sort_by_expert(
    experts: torch.Tensor, tokens_per_expert: torch.Tensor, weights: torch.Tensor, capacity: Optional[int] = None
) -> Dispatch:
    """The dispatch of (tokens, top_k) chosen `experts`, dropless or keeping `capacity` rows per expert."""
    top_k = experts.shape[1]
    if capacity is None:
        return Dispatch(torch.sort(experts.flatten(), stable=True).indices, tokens_per_expert, top_k)
    by_weight = torch.sort(weights.detach().flatten(), descending=True, stable=True).indices
    slots = by_weight[torch.sort(experts.flatten()[by_weight], stable=True).indices]
    starts = tokens_per_expert.cumsum(0) - tokens_per_expert
    expert_of_row = experts.flatten()[slots]
    rank_in_expert = torch.arange(slots.numel(), device=slots.device) - starts[expert_of_row]
    return Dispatch(slots[rank_in_expert < capacity], tokens_per_expert.clamp(max=capacity), top_k)


def permute(hidden: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """(tokens, d) -> (rows, d): each row the token its slot belongs to."""
    return hidden[dispatch.slots // dispatch.top_k]


def combine(rows: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """(rows, d) expert outputs -> (tokens, d) in the weights' dtype (float32 or wider): per token the sum over
    its choices of weight x output (a dropped choice adds nothing), in choice order, the same on every device."""
    tokens, top_k = weights.shape
    dtype = torch.promote_types(rows.dtype, weights.dtype)
    slots = rows.new_zeros(tokens * top_k, rows.shape[1], dtype=dtype)
    slots = slots.index_put((dispatch.slots,), rows.to(dtype))
    return (slots.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
