"""Context parallelism for Mamba-3 by state passing: the scan of one rank's slice as part of the whole sequence.

A slice continues three things from the earlier ones: the cumulative angle (each slice's angle since its last
document start, all-gathered and folded as `state_passing` folds states; the carried offset rotates B̂ and Ĉ),
the previous token's x and rotated B̂ for the trapezoid's first term (a one-token halo from the previous rank),
and the SSM state (the slice is scanned from zero, then the true entering state's exact contribution is added,
as for Mamba-2). A document starting inside a slice stops every carry there. Design: docs/context-parallel.md.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megamamba.kernels.reference.mamba3 import ScanState
from megamamba.kernels.reference.mamba3_inputs import ScanInputs, rotate
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.context.halo import from_previous_rank, previous_ids
from megamamba.parallel.context.state_passing import initial_state, masked_exp, reaches_from_start


class Mamba3Slice:
    """This rank's slice in a `ContextParallel` group, built once per mixer call: the previous rank's last
    document id (exchanged here when `seq_idx` is given), the angle carried in (`continue_angle`) and the
    scan across the rank edges (`scan`, the signature of `scan_fn`, the one-device chunked scan it runs)."""

    def __init__(self, cp: ContextParallel, seq_idx: torch.Tensor | None, scan_fn: Callable, rotation: str):
        self.cp, self.seq_idx, self.scan_fn, self.rotation = cp, seq_idx, scan_fn, rotation
        self.last_previous_id = None if seq_idx is None else previous_ids(seq_idx, 1, cp)[:, -1]

    def _reaches(self, batch: int, seqlen: int, device) -> torch.Tensor:
        """(batch, seqlen) bool: positions the carries from the earlier slices reach."""
        return reaches_from_start(self.seq_idx, self.last_previous_id, batch, seqlen, device)

    def continue_angle(self, inputs: ScanInputs) -> ScanInputs:
        """`inputs` of this slice computed from a zero angle -> as the whole sequence has them: B̂ and Ĉ turned
        on by the angle the earlier slices leave (mod 2π), where it reaches."""
        batch, seqlen = inputs.dt.shape[:2]
        reaches = self._reaches(batch, seqlen, inputs.dt.device)
        kept = reaches[:, -1].to(inputs.angle.dtype)[:, None, None]  # 0 where a document starts in the slice
        carried = torch.remainder(initial_state(kept, inputs.angle[:, -1], self.cp), 2 * math.pi)
        entering = (
            carried.to(inputs.angle.dtype)[:, None] * reaches[..., None, None]
        )  # (batch, seqlen, nheads, nangles)
        turn = entering[:, :, :, None]  # the same for every MIMO rank
        return inputs._replace(
            B=rotate(inputs.B, turn, self.rotation),
            C=rotate(inputs.C, turn, self.rotation),
            angle=torch.remainder(inputs.angle + entering, 2 * math.pi),
        )

    def scan(self, x, dt, A, lam, B, C, chunk_size, D=None, seq_idx=None, return_final_state=False):
        """The chunked scan of the slice (inputs after `continue_angle`), started from the previous rank's last
        token and the state the earlier slices leave."""
        if seq_idx is not self.seq_idx:
            raise ValueError(
                "seq_idx is not the tensor this Mamba3Slice was built with: its ids are the ones the scan uses"
            )
        if return_final_state:
            raise ValueError(
                "inference_state with context parallelism: the recurrent form (prefill, step) needs the whole "
                "sequence on one rank; build the model without a context-parallel group"
            )
        batch, seqlen, nheads, rank, headdim = x.shape
        reaches = self._reaches(batch, seqlen, x.device)
        ct = torch.promote_types(x.dtype, torch.float32)
        tail = torch.cat([x[:, -1].flatten(1), B[:, -1].flatten(1)], dim=1).to(ct)
        halo_x, halo_B = from_previous_rank(tail, self.cp).split([x[0, -1].numel(), B[0, -1].numel()], dim=1)
        first = reaches[:, 0, None, None, None].to(ct)  # no previous-token term where a document starts the slice
        start = ScanState(
            x.new_zeros(batch, nheads, headdim, B.shape[-1], dtype=ct),
            halo_x.view(batch, nheads, rank, headdim) * first,
            halo_B.view(batch, nheads, rank, -1) * first,
        )
        y, final = self.scan_fn(
            x, dt, A, lam, B, C, chunk_size, D=D, initial_state=start, seq_idx=seq_idx, return_final_state=True
        )
        h0 = initial_state(checkpoint(_decay, dt, A, reaches, use_reentrant=False), final.ssm, self.cp)
        contribution = checkpoint(_contribution, C, h0, dt, A, reaches, use_reentrant=False)
        return (y.to(contribution.dtype) + contribution).to(y.dtype)


# Run under `checkpoint`: the backward keeps their inputs (which the scan keeps anyway) and recomputes the rest.


def _decay(dt, A, reaches):
    """The slice's decay per head, (batch, nheads, 1, 1); 0 where a document starts in it."""
    return masked_exp((dt * A).sum(1), reaches[:, -1:])[..., None, None]


def _contribution(C, h0, dt, A, reaches):
    """h0's part of the output, Ĉ_{t,r} . h0 * exp(sum_{s <= t} Δ_s A_s), (batch, seqlen, nheads, rank, headdim)."""
    log_decays = dt * A
    # Summed in float64: a float32 running sum over a long slice drifts by up to length x eps x |sum|.
    from_start = masked_exp(log_decays.double().cumsum(1), reaches[..., None]).to(h0.dtype)
    with torch.autocast(C.device.type, enabled=False):
        read = torch.einsum("blhrn,bhpn->blhrp", C.to(h0.dtype), h0)
    return read * from_start[..., None, None]
