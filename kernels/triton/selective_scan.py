"""Mamba-1 selective scan in Triton: forward and backward, parallel over time inside chunks.

h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t (h restarts from zero where a document starts; h_{-1}
is the initial state, else zero), y_t = C_t . h_t (+ D u_t) (* silu(z_t)). The kernels
(selective_scan_kernels.py) scan CHUNK steps at once per program and carry the state across
chunks; the forward keeps each chunk's entering state (float32, dstate * 4 / CHUNK bytes per
channel and step) for the backward, which recomputes the chunk's states from it.
B and C are input-dependent (batch, groups, dstate, seqlen) or constant (dim, dstate).
"""

import torch
import triton

from ..reference.selective_scan import _as_groups, _check
from . import common
from .selective_scan_kernels import _scan_bwd_kernel, _scan_fwd_kernel

CHUNK = 16  # steps scanned at once: time lives in each thread's registers
BLOCK_D = 8  # channels per program; dB / dC are summed over them in the kernel, over blocks after


def _groups(B, C):
    """Number of groups shared by the input-dependent B / C (1 if both are constant)."""
    counts = {M.shape[1] for M in (B, C) if M.dim() == 4}
    if len(counts) > 1:
        raise ValueError(f"input-dependent B and C must have the same number of groups, got {sorted(counts)}")
    return counts.pop() if counts else 1


def _bc_strides(M):
    """(batch, group, dstate, time) strides; a constant (dim, dstate) M uses (0, dim, dstate, 0)."""
    if M.dim() == 2:
        return (0, M.stride(0), M.stride(1), 0)
    return M.stride()


def _launch(u, A, B, C):
    """Grid, block sizes and the arguments both kernels share after their pointers."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    groups = _groups(B, C)
    block_n = common.block(dstate, lo=2)
    block_d = min(BLOCK_D, common.block(dim // groups, lo=1))
    grid = (batch, groups, triton.cdiv(dim // groups, block_d))
    meta = dict(CHUNK=CHUNK, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=max(1, min(4, block_d * block_n // 32)))
    shared = (dim, dim // groups, dstate, seqlen, triton.cdiv(seqlen, CHUNK))
    return grid, meta, shared


def _flags(D, z, delta_bias, softplus, B, C, doc, init):
    return dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus,
        B_CONST=B.dim() == 2,
        C_CONST=C.dim() == 2,
        HAS_DOC=doc is not None,
        HAS_INIT=init is not None,
    )


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state):
    """(out in u's dtype, the last state (batch, dim, dstate) float32, each chunk's entering state
    (batch, chunks, dim, dstate) float32, which the backward reads); B and C as `_as_groups` gives them."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    A = A.contiguous()
    doc = common.document_counters(seq_idx, batch, seqlen)
    init = initial_state.contiguous() if initial_state is not None else None
    grid, meta, shared = _launch(u, A, B, C)
    out = common.empty((batch, dim, seqlen), device=u.device, dtype=u.dtype)
    ckpt = common.empty((batch, shared[-1], dim, dstate), device=u.device, dtype=torch.float32)
    last = common.empty((batch, dim, dstate), device=u.device, dtype=torch.float32)
    # At most 128 registers: 16 resident warps per SM on sm_90 without spills (ptxas's own
    # choice is up to 145 registers, and a 4-byte spill at 72 for one specialization).
    _scan_fwd_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        doc,
        init,
        out,
        ckpt,
        last,
        *shared,
        *u.stride(),
        *delta.stride(),
        *_bc_strides(B),
        *_bc_strides(C),
        *(z.stride() if z is not None else (0, 0, 0)),
        *out.stride(),
        doc.stride(0) if doc is not None else 0,
        **_flags(D, z, delta_bias, delta_softplus, B, C, doc, init),
        **meta,
        maxnreg=128,
    )
    return out, last, ckpt


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state, ckpt):
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), None for an absent input; dlast
    None when the last state is unused."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    A = A.contiguous()
    doc = common.document_counters(seq_idx, batch, seqlen)
    dlast = dlast.contiguous() if dlast is not None else None  # read as (batch, dim, dstate)
    grid, meta, shared = _launch(u, A, B, C)
    dev = u.device

    def buf(shape, dtype=torch.float32):
        return common.empty(shape, device=dev, dtype=dtype)

    per_step = (batch, grid[1], grid[2], dstate, seqlen)
    du, ddelta = buf(u.shape, u.dtype), buf(u.shape, delta.dtype)
    dz = buf(u.shape, z.dtype) if z is not None else None
    da = buf((batch, dim, dstate))
    db = buf((batch, dim, dstate) if B.dim() == 2 else per_step)
    dc = buf((batch, dim, dstate) if C.dim() == 2 else per_step)
    dd = buf((batch, dim)) if D is not None else None
    dbias = buf((batch, dim)) if delta_bias is not None else None
    dinit = buf((batch, dim, dstate)) if initial_state is not None else None
    flags = _flags(D, z, delta_bias, delta_softplus, B, C, doc, dinit)
    _scan_bwd_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        doc,
        ckpt,
        dout,
        dlast,
        du,
        ddelta,
        dz,
        da,
        db,
        dc,
        dd,
        dbias,
        dinit,
        *shared,
        *u.stride(),
        *delta.stride(),
        *_bc_strides(B),
        *_bc_strides(C),
        *(z.stride() if z is not None else (0, 0, 0)),
        *dout.stride(),
        doc.stride(0) if doc is not None else 0,
        HAS_DLAST=dlast is not None,
        **flags,
        **meta,
    )

    def reduce_bc(grad, M):
        return (grad.sum(0) if M.dim() == 2 else grad.sum(2)).to(M.dtype)

    return (
        du,
        ddelta,
        da.sum(0).to(A.dtype),
        reduce_bc(db, B),
        reduce_bc(dc, C),
        dd.sum(0).to(D.dtype) if D is not None else None,
        dz,
        dbias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None,
        dinit.to(initial_state.dtype) if dinit is not None else None,
    )


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, softplus, seq_idx, initial_state):
        out, last, ckpt = forward(u, delta, A, B, C, D, z, delta_bias, softplus, seq_idx, initial_state)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, seq_idx, initial_state, ckpt)
        ctx.softplus = softplus
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, seq_idx, initial_state, ckpt = ctx.saved_tensors
        grads = backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, ctx.softplus, seq_idx, initial_state, ckpt)
        return *grads[:8], None, None, grads[8]


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
    """Mamba-1 scan (as mamba_ssm's selective_scan_fn, plus seq_idx and initial_state); see
    megamamba.kernels. Returns out in u's dtype [, last_state (batch, dim, dstate) in float32]."""
    _check(u, delta, A, D, z, delta_bias, initial_state)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    B = _as_groups("B", B, batch, dim, dstate, seqlen)
    C = _as_groups("C", C, batch, dim, dstate, seqlen)
    out, last = _SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state)
    return (out, last) if return_last_state else out
