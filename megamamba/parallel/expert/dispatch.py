"""The rows of a mixture-of-experts layer carried to the expert-parallel rank holding their expert, and back.

A rank's rows arrive sorted by expert (`megamamba.model.moe_dispatch`), so the rows for rank q's experts are one
consecutive block: one all-to-all of the per-expert counts tells every rank what it receives, one all-to-all
with those split sizes carries the rows. They arrive by source rank, then by expert; they are sorted by expert
(then source rank, then arrival) for the grouped experts, and unsorted before the all-to-all back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megamamba.parallel.expert.all_to_all import all_to_all, exchange_counts
from megamamba.parallel.expert.expert_parallel import ExpertParallel


class Route(NamedTuple):
    """How rows came: `order` each expert-sorted row's place among the rows that arrived; `sends` / `receives`
    the rows this rank sent to / received from each rank."""

    order: torch.Tensor
    sends: list
    receives: list


def to_expert_ranks(
    rows: torch.Tensor, tokens_per_expert: torch.Tensor, ep: ExpertParallel
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """(rows sorted by expert, (num_experts,) rows per expert) -> (the rows of this rank's experts from every rank
    of `ep`, sorted by expert; (experts here,) rows per expert; the `Route` back). Collective over `ep`; reads
    the counts on the host, as dropless routing must to size the exchange."""
    per_rank = tokens_per_expert.view(ep.size, -1)
    received = exchange_counts(per_rank, ep)  # (source rank, expert here)
    sends, receives = torch.stack([per_rank.sum(1), received.sum(1)]).tolist()  # one host sync
    arrived = all_to_all(rows, sends, receives, ep)
    experts_here = received.shape[1]
    block = torch.arange(received.numel(), device=rows.device)
    expert_of_row = torch.repeat_interleave(block % experts_here, received.flatten(), output_size=arrived.shape[0])
    order = torch.sort(expert_of_row, stable=True).indices
    return arrived[order], received.sum(0), Route(order, sends, receives)


def from_expert_ranks(rows: torch.Tensor, route: Route, ep: ExpertParallel) -> torch.Tensor:
    """The experts' output rows (sorted as `to_expert_ranks` gave them) -> each source rank's rows, in the order
    it sent them. Collective over `ep`."""
    arrival = torch.empty_like(route.order)
    arrival[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    return all_to_all(rows[arrival], route.receives, route.sends, ep)
