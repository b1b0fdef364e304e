"""Public ops: mamba_ssm's signatures over the custom ops (ops.py), which pick the Triton kernel or the
PyTorch reference at each call (choice.py)."""

from typing import Optional

import torch

from . import ops
from .choice import backend  # noqa: F401  (the choice, as this module has always offered it)
from .reference.mamba3 import ScanState
from .reference.mamba3_inputs import ScanInputs
from .reference.selective_scan import _as_groups
from .reference.selective_scan import _check as _check_selective_scan


def _autocast(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes in on t's device now, None when it is off: the reference runs under
    it, as it ran under the caller's autocast before the kernels were ops."""
    device_type = t.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def selective_scan(
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
    initial_state=None,
):
    """Mamba-1 selective scan, as mamba_ssm's selective_scan_fn.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (batch, groups, dstate, seqlen),
    (batch, dstate, seqlen) or (dim, dstate); D, delta_bias: (dim,). delta -> delta + delta_bias ->
    softplus if delta_softplus. out = y (+ D*u) (* silu(z)), (batch, dim, seqlen) in u's dtype,
    and last_state (batch, dim, dstate) when return_last_state. seq_idx (batch, seqlen) int: the
    state restarts from zero wherever the document id changes. initial_state (batch, dim, dstate):
    the state before the first step (it reaches only the first document); differentiable.
    """
    _check_selective_scan(u, delta, A, D, z, delta_bias, initial_state)
    batch, dim, seqlen = u.shape
    B = _as_groups("B", B, batch, dim, A.shape[1], seqlen)
    C = _as_groups("C", C, batch, dim, A.shape[1], seqlen)
    out, last, _ = ops.selective_scan(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, seq_idx, initial_state, _autocast(u)
    )
    return (out, last) if return_last_state else out


def ssd_chunk_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
):
    """Mamba-2 SSD scan, as mamba_ssm's mamba_chunk_scan_combined.

    x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A, dt_bias: (nheads,);
    B, C: (batch, seqlen, ngroups, dstate); D: (nheads,) or (nheads, headdim); initial_states:
    (batch, nheads, headdim, dstate). dt -> dt + dt_bias -> softplus if dt_softplus -> clamp to
    dt_limit. y = scan (+ D*x) (* silu(z)) in x's dtype [, final_states]. seq_idx (batch, seqlen)
    int: the state restarts where the id changes; initial_states reach only the first document.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    y, final = ops.ssd_chunk_scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
        dt_softplus,
        [float(limit) for limit in dt_limit],
        return_final_states,
        _autocast(x),
    )
    return (y, final) if return_final_states else y


def mamba3_scan(x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, return_final_state=False):
    """Mamba-3's exponential-trapezoidal scan, with the arguments and results of the reference's
    `mamba3_scan_chunked` (megamamba.kernels.reference.mamba3): x (batch, seqlen, nheads, rank, headdim); dt,
    A, lam (batch, seqlen, nheads); B̂, Ĉ (batch, seqlen, nheads, rank, dstate); D (nheads,); initial_state
    a ScanState. y in x's compute dtype [, the final ScanState]. Triton runs SISO and MIMO, a MIMO token as
    rank SSD steps (megamamba.kernels.triton.mamba3).
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    initial = (None, None, None) if initial_state is None else tuple(initial_state)
    y, ssm, last_x, last_B = ops.mamba3_scan(x, dt, A, lam, B, C, chunk_size, D, *initial, seq_idx, _autocast(x))
    return (y, ScanState(ssm, last_x, last_B)) if return_final_state else y


def mamba3_scan_inputs(
    B,
    C,
    dd_dt,
    dd_A,
    trap,
    angles,
    dt_bias,
    B_norm_weight,
    C_norm_weight,
    B_bias,
    C_bias,
    A_floor,
    a_activation="heavy_tail",
    rotation="adjacent",
    norm_eps=1e-5,
    seq_idx=None,
    initial_angle=None,
) -> ScanInputs:
    """Mamba-3's preprocessing, in_proj's raw columns -> the scan's inputs, with the arguments and results of
    the reference's `mamba3_scan_inputs` (megamamba.kernels.reference.mamba3_inputs); Triton fuses it into
    one kernel (megamamba.kernels.triton.mamba3_inputs)."""
    outputs = ops.mamba3_scan_inputs(
        B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, float(A_floor),
        a_activation, rotation, float(norm_eps), seq_idx, initial_angle, _autocast(B),
    )  # fmt: skip
    return ScanInputs(*outputs)


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """Depthwise causal conv: x (batch, dim, seqlen), weight (dim, width), bias (dim,).

    activation None, "silu" or "swish"; with seq_idx no tap crosses a document boundary.
    """
    return ops.causal_conv1d(x, weight, bias, seq_idx, activation, _autocast(x))


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm over groups of group_size channels of the last dim, as mamba_ssm's rmsnorm_fn."""
    return ops.rmsnorm_gated(x, weight, bias, z, eps, group_size, norm_before_gate, _autocast(x))


def add_rmsnorm(x, residual, weight, eps=1e-6, residual_dtype=None):
    """Pre-norm of a block: r = x + residual (x when residual is None); returns (rmsnorm(r) * weight in
    weight's dtype, computed on r cast to it; r in residual_dtype, default its own), as mamba_ssm's
    fused add + RMSNorm."""
    normed, r = ops.add_rmsnorm(x, residual, weight, eps, residual_dtype, _autocast(x))
    stores = residual is not None or (residual_dtype is not None and residual_dtype != x.dtype)
    return normed, r if stores else x


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One step of h = exp(dt A) h + dt x B^T, y = h C (+ D x) (* silu z); writes h into `state`.

    Mamba-1 form: state (batch, dim, dstate), x/dt/z (batch, dim), A (dim, dstate), B/C (batch, dstate)
    or (batch, ngroups, dstate), D/dt_bias (dim,). Mamba-2 form: state (batch, nheads, headdim, dstate),
    x/dt/z (batch, nheads, headdim), A (nheads, headdim, dstate), B/C (batch, ngroups, dstate),
    D/dt_bias (nheads, headdim). Returns y shaped like x. The reference on every device.
    """
    return ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Shift conv_state (batch, dim, width) left, append x (batch, dim), return the conv output (batch, dim).
    The reference on every device."""
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation)
