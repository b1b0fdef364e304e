"""Which node holds which rank and (dp, tp, pp) coordinate; refuses tensor groups that span nodes.

A node is its host name and the launcher's node rank (`CROSS_RANK`), so two launchers on one
machine count as two nodes. `topology` is anything with DeepSpeed's `ProcessTopology` interface,
so this module stays free of DeepSpeed. The rule and its report: docs/multinode.md.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from megamamba.errors import MegamambaError


class PlacementError(MegamambaError, ValueError):
    """The ranks' placement on nodes does not suit the layout."""


@dataclass(frozen=True)
class RankPlace:
    rank: int
    host: str
    node_rank: Optional[int]  # the launcher's node rank; None when not started by DeepSpeed's launcher
    local_rank: int

    @property
    def node(self) -> str:
        return self.host if self.node_rank is None else f"{self.host} (node {self.node_rank})"


def this_place(rank: int) -> RankPlace:
    """This process's place, from its host name and the launcher's environment."""
    node_rank = os.environ.get("CROSS_RANK")
    return RankPlace(
        rank,
        socket.gethostname(),
        None if node_rank is None else int(node_rank),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def gather_places() -> list[RankPlace]:
    """Every rank's place, in rank order (collective over the default group)."""
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, this_place(dist.get_rank()))
    return places


def _check_world(places: list[RankPlace], topology) -> None:
    if [p.rank for p in places] != list(range(topology.world_size())):
        raise PlacementError(
            f"placement of ranks {[p.rank for p in places]} does not match the topology's "
            f"world size {topology.world_size()}"
        )


def check_tensor_groups(places: list[RankPlace], topology) -> None:
    """Raise PlacementError naming the first tensor-parallel group that spans nodes, its hosts and the fix."""
    _check_world(places, topology)
    for ranks in topology.get_axis_comm_lists("model"):
        nodes = {places[r].node for r in ranks}
        if len(nodes) > 1:
            tp = len(ranks)
            on = ", ".join(f"rank {r} on {places[r].node}" for r in ranks)
            counts = Counter(p.node for p in places)
            per_node = ", ".join(f"{node}: {n}" for node, n in counts.items())
            raise PlacementError(
                f"tensor-parallel group ranks {ranks} spans {len(nodes)} nodes ({on}); a tensor-parallel group "
                f"must sit inside one node (it all-reduces in every layer). The launcher gives each node consecutive "
                f"ranks, so every node needs a multiple of --tensor-parallel-size {tp} processes (ranks per node "
                f"here: {per_node}): set slots=<multiple of {tp}> for every host in the hostfile (or --num_gpus / "
                f"--include), or choose a tensor-parallel size that divides every node's process count"
            )


def cross_node_stage_pairs(places: list[RankPlace], topology) -> list[tuple[int, int]]:
    """(sending rank, receiving rank) of consecutive pipeline stages that sit on different nodes."""
    _check_world(places, topology)
    pairs = []
    for ranks in topology.get_axis_comm_lists("pipe"):
        pairs += [(a, b) for a, b in zip(ranks, ranks[1:]) if places[a].node != places[b].node]
    return pairs


def placement_table(places: list[RankPlace], topology) -> str:
    """Host, launcher node rank, global rank, local rank and (dp, tp, pp) coordinate of every rank."""
    _check_world(places, topology)
    header = ("host", "node", "rank", "local_rank", "dp", "tp", "pp")
    rows = [header]
    for p in places:
        c = topology.get_coord(p.rank)
        rows.append(
            (
                p.host,
                "-" if p.node_rank is None else str(p.node_rank),
                str(p.rank),
                str(p.local_rank),
                str(c.data),
                str(c.model),
                str(c.pipe),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def placement_report(places: list[RankPlace], topology) -> str:
    """The start-up text: a summary line, the table, and which pipeline boundaries cross nodes."""
    check_tensor_groups(places, topology)
    nodes = len({p.node for p in places})
    sizes = {axis: len(topology.get_axis_comm_lists(axis)[0]) for axis in ("data", "model", "pipe")}
    lines = [
        f"placement: {len(places)} ranks on {nodes} node(s), dp={sizes['data']} tp={sizes['model']} "
        f"pp={sizes['pipe']}; every tensor-parallel group inside one node",
        placement_table(places, topology),
    ]
    pairs = cross_node_stage_pairs(places, topology)
    if pairs:
        lines.append(
            "placement: pipeline stage boundaries across nodes (expected; one activation and one gradient "
            "per micro-batch cross the network): " + ", ".join(f"rank {a} -> {b}" for a, b in pairs)
        )
    return "\n".join(lines)


def check_placement(topology, log: Callable[[str], None] = print) -> list[RankPlace]:
    """Collective start-up check: gather every rank's place, refuse tensor groups across nodes
    (PlacementError on every rank), and log the report on global rank 0. Returns the places."""
    places = gather_places()
    report = placement_report(places, topology)
    if dist.get_rank() == 0:
        log(report)
    return places
