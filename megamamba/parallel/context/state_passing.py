"""Each context-parallel rank's true initial SSM state, from one all-gather of segment summaries.

A slice maps its entering state affinely, h_end = decay * h0 + h_zero; the ranks all-gather
(decay, h_zero) in float32 and rank r folds ranks 0 .. r-1 (backward: one reduce-scatter).
Details: docs/context-parallel.md.
"""

from __future__ import annotations

import torch

from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.collectives import start_all_gather, start_reduce_scatter


def _fold(decays: torch.Tensor, finals: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """States entering slices 0 .. rank: s_0 = 0, s_{j+1} = decay_j * s_j + final_j."""
    states = [torch.zeros_like(finals[0])]
    for j in range(rank):
        states.append(decays[j] * states[-1] + finals[j])
    return states


class _InitialState(torch.autograd.Function):
    """(decay, final) of every rank -> the state entering this rank's slice.

    Forward: one all-gather of the summaries, then the fold. Backward, by hand so that every rank
    takes part (rank 0's state depends on no summary): the fold's gradient for every earlier rank's
    summary, summed back to its owner by one reduce-scatter.
    """

    @staticmethod
    def forward(ctx, decay, final, cp):
        summary = torch.cat([decay.flatten(), final.flatten()]).to(final.dtype)[None]
        gathered = start_all_gather(summary, cp, 0).wait()
        decays, finals = gathered.split([decay.numel(), final.numel()], dim=1)
        decays, finals = decays.unflatten(1, decay.shape), finals.unflatten(1, final.shape)
        states = _fold(decays, finals, cp.rank)
        ctx.cp, ctx.decay_shape = cp, decay.shape
        ctx.save_for_backward(decays, *states[:-1])
        return states[-1]

    @staticmethod
    def backward(ctx, grad):
        decays, *states = ctx.saved_tensors
        grad_decays, grad_finals = torch.zeros_like(decays), grad.new_zeros((decays.shape[0], *grad.shape))
        for j in reversed(range(ctx.cp.rank)):  # grad: of the state leaving slice j
            grad_finals[j] = grad
            grad_decays[j] = (grad * states[j]).sum_to_size(ctx.decay_shape)
            grad = decays[j] * grad
        summary = torch.cat([grad_decays.flatten(1), grad_finals.flatten(1)], dim=1)
        own = start_reduce_scatter(summary, ctx.cp, 0).wait()[0]
        grad_decay, grad_final = own.split([grad_decays[0].numel(), grad_finals[0].numel()])
        return grad_decay.view(ctx.decay_shape), grad_final.view(grad.shape), None


def initial_state(decay: torch.Tensor, final: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The state entering this rank's slice (`final`'s shape and dtype, at least float32; zeros on rank 0).

    decay: this slice's decay, broadcastable to final; final: its zero-start final state.
    """
    ct = torch.promote_types(final.dtype, torch.float32)
    return _InitialState.apply(decay.to(ct), final.to(ct), cp)


def reaches_from_start(
    seq_idx: torch.Tensor | None, last_previous_id: torch.Tensor | None, batch: int, seqlen: int, device
) -> torch.Tensor:
    """(batch, seqlen) bool: True where the state entering the slice still counts, i.e. every id up to
    the position equals the previous rank's last id (no document starts in between)."""
    if seq_idx is None:
        return torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    same = (seq_idx == last_previous_id[:, None]).to(torch.int32)
    return same.cummin(dim=1).values.bool()


def masked_exp(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(logits) where keep, exactly 0 elsewhere (masked before exp: no inf, no NaN gradient)."""
    return torch.exp(logits.masked_fill(~keep, float("-inf")))
