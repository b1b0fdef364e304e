"""The all-to-all of expert parallelism with variable split sizes (dropless routing), as an autograd function
whose backward is the all-to-all back, recorded in `comm_counter` as "all_to_all" (bytes: what this rank sends).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megamamba.parallel.comm_counter import comm_counter
from megamamba.parallel.expert.expert_parallel import ExpertParallel


def _exchange(rows: torch.Tensor, sends: list, receives: list, ep: ExpertParallel) -> torch.Tensor:
    out = rows.new_empty((sum(receives), *rows.shape[1:]))
    comm_counter.record("all_to_all", rows.nbytes, ep.size)
    dist.all_to_all_single(out, rows.contiguous(), receives, sends, group=ep.group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, sends: list, receives: list, ep: ExpertParallel) -> torch.Tensor:
        ctx.sends, ctx.receives, ctx.ep = sends, receives, ep
        return _exchange(rows, sends, receives, ep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.receives, ctx.sends, ctx.ep), None, None, None


def all_to_all(rows: torch.Tensor, sends: list, receives: list, ep: ExpertParallel) -> torch.Tensor:
    """(sum(sends), ...) -> (sum(receives), ...): rank r's `sends[q]` consecutive rows go to rank q, which
    receives them as its `receives[r]` rows from r, in rank order; differentiable."""
    return _AllToAll.apply(rows, sends, receives, ep)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """(P, k) int64, row q what this rank sends rank q -> (P, k), row r what rank r sends this one."""
    out = torch.empty_like(counts)
    comm_counter.record("all_to_all", counts.nbytes, ep.size)
    dist.all_to_all_single(out, counts.contiguous(), group=ep.group)
    return out
