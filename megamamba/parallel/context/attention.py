"""Attention under context parallelism: every rank's keys and values, gathered over the CP group.

Each rank attends its own queries (a slice of the sequence) to the keys and values of the whole
sequence: one all-gather of K and V forward, whose backward reduce-scatters dK and dV to the ranks
that own those positions. The document ids of the keys are gathered the same way (no gradient).
The causal and document masks then work in global positions (`megamamba.model.causal_attention`).
Every rank holds, and keeps for the backward, the whole sequence's K and V: O(L) per rank, not L / C.
"""

import torch

from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.collectives import gather_from_sequence_region, start_all_gather
from megamamba.parallel.tensor.tensor_parallel import SEQ_DIM


def gather_keys_values(k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k, v (batch, slice, kv_heads, head_dim) -> the whole sequence's, in one all-gather."""
    heads = k.shape[2]
    kv = gather_from_sequence_region(torch.cat([k, v], dim=2), cp)
    return kv[:, :, :heads], kv[:, :, heads:]


def gather_ids(seq_idx: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """This rank's document ids (batch, slice) -> the whole sequence's."""
    return start_all_gather(seq_idx, cp, SEQ_DIM).wait()
