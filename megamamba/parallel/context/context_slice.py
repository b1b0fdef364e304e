"""Context parallelism by state passing: the conv and scan of one rank's slice of every sequence.

A `ContextSlice`, built once per mixer call, has the kernels' `causal_conv1d`, `ssd_chunk_scan`
and `selective_scan` signatures and returns what they would for these positions of the whole
sequence: a conv halo, a zero-start scan, and the true initial state's exact contribution added
after. Design, derivation and byte counts: docs/context-parallel.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megamamba.kernels import selective_scan, ssd_chunk_scan
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.context.halo import causal_conv1d_with_halo, previous_ids
from megamamba.parallel.context.state_passing import initial_state, masked_exp, reaches_from_start


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _refuse_final_state(requested: bool) -> None:
    """Refuse the prefill cache's final states: generation runs on one rank's whole sequence."""
    if requested:
        raise ValueError(
            "inference_state with context parallelism: the recurrent form (prefill, step) needs "
            "the whole sequence on one rank; build the model without a context-parallel group"
        )


class ContextSlice:
    """This rank's slice in a `ContextParallel` group: the previous rank's document ids (exchanged
    here when `seq_idx` is given) and the conv and scans across the rank edges. The methods take the
    kernels' arguments, `seq_idx` being the one given here, so a mixer calls either the same way."""

    def __init__(self, cp: ContextParallel, seq_idx: torch.Tensor | None, conv_width: int):
        self.cp, self.seq_idx = cp, seq_idx
        self.halo_ids = None if seq_idx is None else previous_ids(seq_idx, max(conv_width - 1, 1), cp)

    def _check_ids(self, seq_idx: torch.Tensor | None) -> None:
        if seq_idx is not self.seq_idx:
            raise ValueError(
                "seq_idx is not the tensor this ContextSlice was built with: its ids (and the previous "
                "rank's, exchanged then) are the ones the conv and scans use"
            )

    def _reaches(self, batch: int, seqlen: int, device) -> torch.Tensor:
        """(batch, seqlen) bool: positions the entering state reaches."""
        last = None if self.halo_ids is None else self.halo_ids[:, -1]
        return reaches_from_start(self.seq_idx, last, batch, seqlen, device)

    def causal_conv1d(self, x, weight, bias=None, seq_idx=None, activation=None):
        """`megamamba.kernels.causal_conv1d` of the slice x (batch, dim, seqlen), with the halo."""
        self._check_ids(seq_idx)
        return causal_conv1d_with_halo(
            x, weight, bias, self.cp, seq_idx=self.seq_idx, halo_ids=self.halo_ids, activation=activation
        )

    def ssd_chunk_scan(
        self,
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        seq_idx=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
    ):
        """`megamamba.kernels.ssd_chunk_scan` of the slice, started from the state the earlier slices leave."""
        self._check_ids(seq_idx)
        _refuse_final_state(return_final_states)
        y, final = ssd_chunk_scan(
            x,
            dt,
            A,
            B,
            C,
            chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            seq_idx=self.seq_idx,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            return_final_states=True,
        )
        reaches = self._reaches(x.shape[0], x.shape[1], x.device)
        dt_args = (dt, dt_bias, A, reaches, dt_softplus, dt_limit)
        h0 = initial_state(checkpoint(_ssd_decay, *dt_args, use_reentrant=False), final, self.cp)
        contribution = checkpoint(_ssd_contribution, C, h0, z, *dt_args, use_reentrant=False)
        return (y.to(contribution.dtype) + contribution).to(y.dtype)

    def selective_scan(
        self,
        u,
        delta,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        seq_idx=None,
    ):
        """`megamamba.kernels.selective_scan` of the slice, started from the state the earlier slices leave."""
        self._check_ids(seq_idx)
        _refuse_final_state(return_last_state)
        y, final = selective_scan(
            u,
            delta,
            A,
            B,
            C,
            D=D,
            z=z,
            delta_bias=delta_bias,
            delta_softplus=delta_softplus,
            return_last_state=True,
            seq_idx=self.seq_idx,
        )
        reaches = self._reaches(u.shape[0], u.shape[2], u.device)
        decay = checkpoint(_selective_decay, delta, delta_bias, A, reaches, delta_softplus, use_reentrant=False)
        h0 = initial_state(decay, final, self.cp) * reaches[:, 0, None, None]
        ct = _compute_dtype(u)
        zeros = torch.zeros((), dtype=ct, device=u.device).expand_as(u)  # the contribution comes back in ct
        contribution = checkpoint(
            selective_scan,
            zeros,
            delta,
            A,
            B,
            C,
            z=z,
            delta_bias=delta_bias,
            delta_softplus=delta_softplus,
            seq_idx=self.seq_idx,
            initial_state=h0,
            use_reentrant=False,
        )
        return (y.to(ct) + contribution).to(y.dtype)


# The pieces below run under `checkpoint`: the backward keeps their inputs (which the scan keeps
# anyway) and recomputes the rest, so the state passing adds no sequence-length-sized activations.


def _ssd_log_decays(dt, dt_bias, A, dt_softplus, dt_limit):
    """dt * A (batch, seqlen, nheads) as the SSD kernel computes it (bias, softplus, clamp)."""
    ct = _compute_dtype(dt)
    dt = dt.to(ct) if dt_bias is None else dt.to(ct) + dt_bias.to(ct)
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(min=dt_limit[0], max=dt_limit[1])
    return dt * A.to(ct)


def _ssd_decay(dt, dt_bias, A, reaches, dt_softplus, dt_limit):
    """The slice's decay per head, (batch, nheads, 1, 1); 0 where a document starts in it."""
    log_decays = _ssd_log_decays(dt, dt_bias, A, dt_softplus, dt_limit)
    return masked_exp(log_decays.sum(1), reaches[:, -1:])[..., None, None]


def _ssd_contribution(C, h0, z, dt, dt_bias, A, reaches, dt_softplus, dt_limit):
    """h0's part of the SSD output, C_t . h0 * exp(sum_{s <= t} dt_s A) (* silu(z)),
    (batch, seqlen, nheads, headdim)."""
    batch, seqlen, nheads = dt.shape
    _, _, headdim, dstate = h0.shape
    ngroups = C.shape[2]
    log_decays = _ssd_log_decays(dt, dt_bias, A, dt_softplus, dt_limit)
    # Summed in float64: a float32 running sum over a long slice drifts by up to length x eps x |sum|.
    from_start = masked_exp(log_decays.double().cumsum(1), reaches[..., None]).to(log_decays.dtype)
    with torch.autocast(C.device.type, enabled=False):  # in float32 as the kernel reads its state, not in bf16
        read = torch.einsum("blgn,bgrpn->blgrp", C.to(h0.dtype), h0.reshape(batch, ngroups, -1, headdim, dstate))
    out = read.reshape(batch, seqlen, nheads, headdim) * from_start[..., None]
    return out if z is None else out * F.silu(z.to(out.dtype))


def _selective_decay(delta, delta_bias, A, reaches, delta_softplus):
    """The slice's decay per (channel, state), (batch, dim, dstate); 0 where a document starts in it."""
    ct = _compute_dtype(delta)
    delta = delta.to(ct) if delta_bias is None else delta.to(ct) + delta_bias.to(ct)[:, None]
    delta = F.softplus(delta) if delta_softplus else delta
    return masked_exp(delta.sum(-1)[..., None] * A.to(ct), reaches[:, -1, None, None])
