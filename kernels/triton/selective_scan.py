"""Mamba-1 selective scan in Triton: forward and backward.

h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t (h restarts from zero where a document starts),
y_t = C_t . h_t (+ D u_t) (* silu(z_t)). Each program owns a block of channels of one group
of one batch row and walks the sequence step by step with its (channels, dstate) state in
float32 registers. Every CHECKPOINT steps the forward stores the state entering the stretch;
the backward walks the stretches last to first: it replays a stretch from its checkpoint
into a scratch buffer, then runs the adjoint recurrence backwards through it, so it never
divides by a decay and the state memory is O(seqlen / CHECKPOINT).
B and C are input-dependent (batch, groups, dstate, seqlen) or constant (dim, dstate).
"""
import torch
import triton
import triton.language as tl

from ..reference.selective_scan import _as_groups, _check
from . import common

_BLOCK_D = 16
CHECKPOINT = 32


@triton.jit
def _softplus(v):
    return tl.maximum(v, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(v)))


@triton.jit
def _step_inputs(u_ptr, delta_ptr, bias_ptr, b_ptr, c_ptr, doc_ptr, b, g, d, d_mask, n, n_mask, dn_mask, t,
                 sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl, sqb,
                 HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, B_CONST: tl.constexpr,
                 C_CONST: tl.constexpr, HAS_DOC: tl.constexpr):
    """u_t, raw delta_t (+ bias), delta_t, B_t, C_t and "a document starts at t" for one step."""
    u = tl.load(u_ptr + b * sub + d * sud + t * sul, mask=d_mask, other=0.0).to(tl.float32)
    raw = tl.load(delta_ptr + b * sdb + d * sdd + t * sdl, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    dl = raw
    if SOFTPLUS:
        dl = _softplus(raw)
    if B_CONST:
        bt = tl.load(b_ptr + d[:, None] * sbg + n[None, :] * sbn, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        bt = tl.load(b_ptr + b * sbb + g * sbg + n * sbn + t * sbl, mask=n_mask, other=0.0)
        bt = bt.to(tl.float32)[None, :]
    if C_CONST:
        ct = tl.load(c_ptr + d[:, None] * scg + n[None, :] * scn, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        ct = tl.load(c_ptr + b * scb + g * scg + n * scn + t * scl, mask=n_mask, other=0.0)
        ct = ct.to(tl.float32)[None, :]
    starts = t < 0
    if HAS_DOC:
        starts = (t > 0) & (tl.load(doc_ptr + b * sqb + t) != tl.load(doc_ptr + b * sqb + tl.maximum(t - 1, 0)))
    return u, raw, dl, bt, ct, starts


@triton.jit
def _scan_fwd_kernel(u_ptr, delta_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, doc_ptr,
                     out_ptr, ckpt_ptr, last_ptr,
                     dim, per_group, dstate, seqlen, n_ckpt,
                     sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl,
                     szb, szd, szl, sob, sod, sol, sqb,
                     HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SOFTPLUS: tl.constexpr, B_CONST: tl.constexpr, C_CONST: tl.constexpr,
                     HAS_DOC: tl.constexpr, CKPT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """out (u's dtype), ckpt[b, k, d, n] = state before step k*CKPT, last[b, d, n] (float32)."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d = g * per_group + j
    d_mask = j < per_group
    n = tl.arange(0, BLOCK_N)
    n_mask = n < dstate
    dn_mask = d_mask[:, None] & n_mask[None, :]
    a = tl.load(a_ptr + d[:, None] * dstate + n[None, :], mask=dn_mask, other=0.0).to(tl.float32)
    if HAS_D:
        dd = tl.load(d_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    state_offs = d[:, None] * dstate + n[None, :]
    zero = b * 0  # int64: time offsets are computed in 64 bits, whatever the loop variable's type
    for step in range(0, seqlen):
        t = zero + step
        if t % CKPT == 0:
            tl.store(ckpt_ptr + (b * n_ckpt + t // CKPT) * dim * dstate + state_offs, h, mask=dn_mask)
        u, raw, dl, bt, ct, starts = _step_inputs(
            u_ptr, delta_ptr, bias_ptr, b_ptr, c_ptr, doc_ptr, b, g, d, d_mask, n, n_mask, dn_mask, t,
            sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl, sqb,
            HAS_BIAS, SOFTPLUS, B_CONST, C_CONST, HAS_DOC)
        h = tl.where(starts, 0.0, h)
        h = tl.exp(dl[:, None] * a) * h + (dl * u)[:, None] * bt
        y = tl.sum(h * ct, axis=1)
        if HAS_D:
            y += dd * u
        if HAS_Z:
            z = tl.load(z_ptr + b * szb + d * szd + t * szl, mask=d_mask, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + b * sob + d * sod + t * sol, y.to(out_ptr.dtype.element_ty), mask=d_mask)
    tl.store(last_ptr + b * dim * dstate + state_offs, h, mask=dn_mask)


@triton.jit
def _scan_bwd_kernel(u_ptr, delta_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, doc_ptr,
                     ckpt_ptr, scratch_ptr, dout_ptr, dlast_ptr,
                     du_ptr, ddelta_ptr, dz_ptr, da_ptr, db_ptr, dc_ptr, dd_ptr, dbias_ptr,
                     dim, per_group, dstate, seqlen, n_ckpt,
                     sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl,
                     szb, szd, szl, sgb, sgd, sgl, sqb,
                     HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SOFTPLUS: tl.constexpr, B_CONST: tl.constexpr, C_CONST: tl.constexpr,
                     HAS_DOC: tl.constexpr, HAS_DLAST: tl.constexpr, CKPT: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """du, ddelta, dz (contiguous (batch, dim, seqlen)); dB / dC per step and channel block
    (batch, groups, blocks, dstate, seqlen) when input-dependent, else per batch row
    (batch, dim, dstate); dA (batch, dim, dstate), dD and d delta_bias (batch, dim) partials.

    With dh the gradient of h_t: dh_t = C_t g_t + exp(delta_{t+1} A) dh_{t+1} (cut where a
    document starts at t+1), g_t = the gradient of y_t.
    """
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pid_j = tl.program_id(2)
    j = pid_j * BLOCK_D + tl.arange(0, BLOCK_D)
    d = g * per_group + j
    d_mask = j < per_group
    n = tl.arange(0, BLOCK_N)
    n_mask = n < dstate
    dn_mask = d_mask[:, None] & n_mask[None, :]
    state_offs = d[:, None] * dstate + n[None, :]
    a = tl.load(a_ptr + state_offs, mask=dn_mask, other=0.0).to(tl.float32)
    if HAS_D:
        dd = tl.load(d_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_DLAST:
        dh = tl.load(dlast_ptr + b * dim * dstate + state_offs, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    da_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dc_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dd_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    scratch = scratch_ptr + b * dim * CKPT * dstate + d[:, None] * CKPT * dstate + n[None, :]
    n_blocks = tl.num_programs(2)
    zero = b * 0  # int64: time offsets are computed in 64 bits, whatever the loop variable's type
    for i in range(0, n_ckpt):
        k = zero + (n_ckpt - 1 - i)
        t_start = k * CKPT
        t_end = tl.minimum(t_start + CKPT, seqlen)
        ckpt = tl.load(ckpt_ptr + (b * n_ckpt + k) * dim * dstate + state_offs, mask=dn_mask, other=0.0)
        # Replay the stretch: scratch[t - t_start] = h_t.
        h = ckpt
        for t in range(t_start, t_end):
            u, raw, dl, bt, ct, starts = _step_inputs(
                u_ptr, delta_ptr, bias_ptr, b_ptr, c_ptr, doc_ptr, b, g, d, d_mask, n, n_mask, dn_mask, t,
                sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl, sqb,
                HAS_BIAS, SOFTPLUS, B_CONST, C_CONST, HAS_DOC)
            h = tl.where(starts, 0.0, h)
            h = tl.exp(dl[:, None] * a) * h + (dl * u)[:, None] * bt
            tl.store(scratch + (t - t_start) * dstate, h, mask=dn_mask)
        tl.debug_barrier()
        for r in range(0, t_end - t_start):
            t = t_end - 1 - r
            u, raw, dl, bt, ct, starts = _step_inputs(
                u_ptr, delta_ptr, bias_ptr, b_ptr, c_ptr, doc_ptr, b, g, d, d_mask, n, n_mask, dn_mask, t,
                sub, sud, sul, sdb, sdd, sdl, sbb, sbg, sbn, sbl, scb, scg, scn, scl, sqb,
                HAS_BIAS, SOFTPLUS, B_CONST, C_CONST, HAS_DOC)
            h = tl.load(scratch + (t - t_start) * dstate, mask=dn_mask, other=0.0)
            h_prev = tl.load(scratch + tl.maximum(t - t_start - 1, 0) * dstate, mask=dn_mask, other=0.0)
            h_prev = tl.where(t > t_start, h_prev, ckpt)
            h_prev = tl.where(starts, 0.0, h_prev)
            grad = tl.load(dout_ptr + b * sgb + d * sgd + t * sgl, mask=d_mask, other=0.0).to(tl.float32)
            if HAS_Z:
                z = tl.load(z_ptr + b * szb + d * szd + t * szl, mask=d_mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(z)
                y = tl.sum(h * ct, axis=1)
                if HAS_D:
                    y += dd * u
                tl.store(dz_ptr + (b * dim + d) * seqlen + t, grad * y * sig * (1.0 + z * (1.0 - sig)),
                         mask=d_mask)
                grad = grad * z * sig
            dh += grad[:, None] * ct
            decay = tl.exp(dl[:, None] * a)
            dbu = dh * (dl * u)[:, None]
            if C_CONST:
                dc_acc += grad[:, None] * h
            else:
                tl.store(dc_ptr + ((((b * tl.num_programs(1) + g) * n_blocks + pid_j) * dstate + n) * seqlen + t),
                         tl.sum(grad[:, None] * h, axis=0), mask=n_mask)
            if B_CONST:
                db_acc += dbu
            else:
                tl.store(db_ptr + ((((b * tl.num_programs(1) + g) * n_blocks + pid_j) * dstate + n) * seqlen + t),
                         tl.sum(dbu, axis=0), mask=n_mask)
            du = tl.sum(dh * bt, axis=1) * dl
            if HAS_D:
                du += dd * grad
                dd_acc += grad * u
            tl.store(du_ptr + (b * dim + d) * seqlen + t, du, mask=d_mask)
            dexp = dh * decay * h_prev
            da_acc += dexp * dl[:, None]
            ddl = tl.sum(dh * bt, axis=1) * u + tl.sum(dexp * a, axis=1)
            if SOFTPLUS:
                ddl = ddl * tl.sigmoid(raw)
            tl.store(ddelta_ptr + (b * dim + d) * seqlen + t, ddl, mask=d_mask)
            dbias_acc += ddl
            dh = tl.where(starts, 0.0, dh * decay)
        tl.debug_barrier()
    tl.store(da_ptr + b * dim * dstate + state_offs, da_acc, mask=dn_mask)
    if B_CONST:
        tl.store(db_ptr + b * dim * dstate + state_offs, db_acc, mask=dn_mask)
    if C_CONST:
        tl.store(dc_ptr + b * dim * dstate + state_offs, dc_acc, mask=dn_mask)
    if HAS_D:
        tl.store(dd_ptr + b * dim + d, dd_acc, mask=d_mask)
    if HAS_BIAS:
        tl.store(dbias_ptr + b * dim + d, dbias_acc, mask=d_mask)


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


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, doc, softplus):
        batch, dim, seqlen = u.shape
        dstate = A.shape[1]
        groups = _groups(B, C)
        n_ckpt = triton.cdiv(seqlen, CHECKPOINT)
        out = common.empty((batch, dim, seqlen), device=u.device, dtype=u.dtype)
        ckpt = common.empty((batch, n_ckpt, dim, dstate), device=u.device, dtype=torch.float32)
        last = common.empty((batch, dim, dstate), device=u.device, dtype=torch.float32)
        grid = (batch, groups, triton.cdiv(dim // groups, _BLOCK_D))
        _scan_fwd_kernel[grid](
            u, delta, A, B, C, D, z, delta_bias, doc, out, ckpt, last,
            dim, dim // groups, dstate, seqlen, n_ckpt, *u.stride(), *delta.stride(), *_bc_strides(B),
            *_bc_strides(C), *(z.stride() if z is not None else (0, 0, 0)), *out.stride(),
            doc.stride(0) if doc is not None else 0,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus,
            B_CONST=B.dim() == 2, C_CONST=C.dim() == 2, HAS_DOC=doc is not None, CKPT=CHECKPOINT,
            BLOCK_D=_BLOCK_D, BLOCK_N=common.block(dstate, lo=2))
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, doc, ckpt)
        ctx.softplus = softplus
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, doc, ckpt = ctx.saved_tensors
        batch, dim, seqlen = u.shape
        dstate = A.shape[1]
        groups = _groups(B, C)
        n_blocks = triton.cdiv(dim // groups, _BLOCK_D)
        dev = u.device

        def buf(shape):
            return common.empty(shape, device=dev, dtype=torch.float32)

        per_step = (batch, groups, n_blocks, dstate, seqlen)
        du, ddelta = buf((batch, dim, seqlen)), buf((batch, dim, seqlen))
        dz = buf((batch, dim, seqlen)) if z is not None else None
        da = buf((batch, dim, dstate))
        db = buf((batch, dim, dstate) if B.dim() == 2 else per_step)
        dc = buf((batch, dim, dstate) if C.dim() == 2 else per_step)
        dd = buf((batch, dim)) if D is not None else None
        dbias = buf((batch, dim)) if delta_bias is not None else None
        scratch = buf((batch, dim, CHECKPOINT, dstate))
        _scan_bwd_kernel[(batch, groups, n_blocks)](
            u, delta, A, B, C, D, z, delta_bias, doc, ckpt, scratch, dout, dlast,
            du, ddelta, dz, da, db, dc, dd, dbias,
            dim, dim // groups, dstate, seqlen, ckpt.shape[1], *u.stride(), *delta.stride(), *_bc_strides(B),
            *_bc_strides(C), *(z.stride() if z is not None else (0, 0, 0)), *dout.stride(),
            doc.stride(0) if doc is not None else 0,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            SOFTPLUS=ctx.softplus, B_CONST=B.dim() == 2, C_CONST=C.dim() == 2, HAS_DOC=doc is not None,
            HAS_DLAST=dlast is not None, CKPT=CHECKPOINT, BLOCK_D=_BLOCK_D, BLOCK_N=common.block(dstate, lo=2))

        def reduce_bc(grad, M):
            return (grad.sum(0) if M.dim() == 2 else grad.sum(2)).to(M.dtype)

        return (du.to(u.dtype), ddelta.to(delta.dtype), da.sum(0).to(A.dtype), reduce_bc(db, B),
                reduce_bc(dc, C), dd.sum(0).to(D.dtype) if D is not None else None,
                dz.to(z.dtype) if z is not None else None,
                dbias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None, None, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, seq_idx=None):
    """Mamba-1 scan (as mamba_ssm's selective_scan_fn, plus seq_idx); see megamamba.kernels.

    Returns out in u's dtype [, last_state (batch, dim, dstate) in float32].
    """
    _check(u, delta, A, D, z, delta_bias)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    B = _as_groups("B", B, batch, dim, dstate, seqlen)
    C = _as_groups("C", C, batch, dim, dstate, seqlen)
    doc = common.document_counters(seq_idx, batch, seqlen)
    out, last = _SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias, doc, delta_softplus)
    return (out, last) if return_last_state else out
