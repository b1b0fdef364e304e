"""Triton kernels of the Mamba-1 selective scan, parallel over time inside chunks.

Inside a chunk the recurrence is one tl.associative_scan over time; the backward recomputes each
chunk's states from its saved entering state and runs the adjoint as a reverse scan. Nothing
divides by a decay. The tiling and the recurrences: docs/code.md ("How the kernels compute").
"""

import triton
import triton.language as tl

from . import common
from .common import combine_steps


@triton.jit
def _delta(delta_ptr, bias, b, d, d_mask, t, t_mask, sdb, sdd, sdl, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Raw delta (+ bias) and delta at steps t for channels d, (CHUNK, BLOCK_D) float32. delta is 0
    off the mask (the step then leaves the state as it is)."""
    mask = t_mask[:, None] & d_mask[None, :]
    raw = tl.load(delta_ptr + b * sdb + d[None, :] * sdd + t[:, None] * sdl, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += bias[None, :]
    dl = raw
    if SOFTPLUS:
        dl = common.softplus(raw)
    return raw, tl.where(mask, dl, 0.0)


@triton.jit
def _decay(
    delta_ptr,
    bias,
    a,
    doc_ptr,
    b,
    d,
    d_mask,
    t,
    t_mask,
    sdb,
    sdd,
    sdl,
    sqb,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_DOC: tl.constexpr,
):
    """(raw delta, delta (CHUNK, BLOCK_D), a_t = exp(delta_t A) (CHUNK, BLOCK_D, BLOCK_N)); a_t is 0
    where a document starts (never at t = 0) and 1 off the mask."""
    raw, dl = _delta(delta_ptr, bias, b, d, d_mask, t, t_mask, sdb, sdd, sdl, HAS_BIAS, SOFTPLUS)
    decay = tl.exp(dl[:, :, None] * a[None, :, :])
    if HAS_DOC:
        inside = (t > 0) & t_mask
        here = tl.load(doc_ptr + b * sqb + t, mask=inside, other=0)
        before = tl.load(doc_ptr + b * sqb + t - 1, mask=inside, other=0)
        decay = tl.where((inside & (here != before))[:, None, None], 0.0, decay)
    return raw, dl, decay


@triton.jit
def _bc(ptr, b, g, d, d_mask, n, n_mask, t, t_mask, sb, sg, sn, sl, CONST: tl.constexpr):
    """B or C as a float32 tile: (CHUNK, 1, BLOCK_N) per step of group g, or (1, BLOCK_D, BLOCK_N)
    from the constant (dim, dstate) matrix."""
    if CONST:
        m = tl.load(ptr + d[:, None] * sg + n[None, :] * sn, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        m = m.to(tl.float32)[None, :, :]
    else:
        m = tl.load(
            ptr + b * sb + g * sg + n[None, :] * sn + t[:, None] * sl, mask=t_mask[:, None] & n_mask[None, :], other=0.0
        )
        m = m.to(tl.float32)[:, None, :]
    return m


@triton.jit
def _row(x, steps, i: tl.constexpr):
    """Row i of a (CHUNK, BLOCK_D, BLOCK_N) tile (the time axis lives in one thread: no traffic)."""
    return tl.sum(tl.where(steps[:, None, None] == i, x, 0.0), axis=0)


@triton.jit
def _scan_fwd_kernel(
    u_ptr,
    delta_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    z_ptr,
    bias_ptr,
    doc_ptr,
    init_ptr,
    out_ptr,
    ckpt_ptr,
    last_ptr,
    dim,
    per_group,
    dstate,
    seqlen,
    n_chunks,
    sub,
    sud,
    sul,
    sdb,
    sdd,
    sdl,
    sbb,
    sbg,
    sbn,
    sbl,
    scb,
    scg,
    scn,
    scl,
    szb,
    szd,
    szl,
    sob,
    sod,
    sol,
    sqb,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    B_CONST: tl.constexpr,
    C_CONST: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_INIT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out (its dtype); ckpt[b, k, d, n] = the state entering chunk k and last[b, d, n], float32.
    A and the initial state are contiguous."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d = g * per_group + j
    d_mask = j < per_group
    n = tl.arange(0, BLOCK_N)
    n_mask = n < dstate
    dn_mask = d_mask[:, None] & n_mask[None, :]
    state_offs = d[:, None] * dstate + n[None, :]
    a = tl.load(a_ptr + state_offs, mask=dn_mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32) if HAS_BIAS else None
    dd = tl.load(d_ptr + d, mask=d_mask, other=0.0).to(tl.float32) if HAS_D else None
    if HAS_INIT:
        h = tl.load(init_ptr + b * dim * dstate + state_offs, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    steps = tl.arange(0, CHUNK)
    for k in range(0, n_chunks):
        tl.store(ckpt_ptr + (b * n_chunks + k) * dim * dstate + state_offs, h, mask=dn_mask)
        t = (k * CHUNK + steps).to(tl.int64)
        t_mask = t < seqlen
        td_mask = t_mask[:, None] & d_mask[None, :]
        u = tl.load(u_ptr + b * sub + d[None, :] * sud + t[:, None] * sul, mask=td_mask, other=0.0).to(tl.float32)
        raw, dl, decay = _decay(
            delta_ptr, bias, a, doc_ptr, b, d, d_mask, t, t_mask, sdb, sdd, sdl, sqb, HAS_BIAS, SOFTPLUS, HAS_DOC
        )
        inp = (dl * u)[:, :, None] * _bc(b_ptr, b, g, d, d_mask, n, n_mask, t, t_mask, sbb, sbg, sbn, sbl, B_CONST)
        prod, acc = tl.associative_scan((decay, inp), 0, combine_steps)
        hs = prod * h[None, :, :] + acc
        y = tl.sum(hs * _bc(c_ptr, b, g, d, d_mask, n, n_mask, t, t_mask, scb, scg, scn, scl, C_CONST), axis=2)
        if HAS_D:
            y += dd[None, :] * u
        if HAS_Z:
            z = tl.load(z_ptr + b * szb + d[None, :] * szd + t[:, None] * szl, mask=td_mask, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + b * sob + d[None, :] * sod + t[:, None] * sol, y.to(out_ptr.dtype.element_ty), mask=td_mask)
        h = _row(hs, steps, CHUNK - 1)  # steps past the end leave the state as it is
    tl.store(last_ptr + b * dim * dstate + state_offs, h, mask=dn_mask)


@triton.jit
def _scan_bwd_kernel(
    u_ptr,
    delta_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    z_ptr,
    bias_ptr,
    doc_ptr,
    ckpt_ptr,
    dout_ptr,
    dlast_ptr,
    du_ptr,
    ddelta_ptr,
    dz_ptr,
    da_ptr,
    db_ptr,
    dc_ptr,
    dd_ptr,
    dbias_ptr,
    dinit_ptr,
    dim,
    per_group,
    dstate,
    seqlen,
    n_chunks,
    sub,
    sud,
    sul,
    sdb,
    sdd,
    sdl,
    sbb,
    sbg,
    sbn,
    sbl,
    scb,
    scg,
    scn,
    scl,
    szb,
    szd,
    szl,
    sgb,
    sgd,
    sgl,
    sqb,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    B_CONST: tl.constexpr,
    C_CONST: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_DLAST: tl.constexpr,
    HAS_INIT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """du, ddelta, dz (contiguous (batch, dim, seqlen), their inputs' dtypes); dB / dC summed over
    the program's channels per step (batch, groups, blocks, dstate, seqlen) when input-dependent,
    else per batch row (batch, dim, dstate); dA (batch, dim, dstate), dD and d delta_bias
    (batch, dim) per batch row; d initial state (batch, dim, dstate); all float32 but the first three.

    w = a_{t1} dh_{t1}, the adjoint handed from the first step t1 of a chunk to the chunk before
    (dlast for the last chunk): inside a chunk dh_t = g_t C_t + a_{t+1} dh_{t+1}, its last step
    taking w instead; for chunk 0 it is the initial state's gradient.
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
    bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32) if HAS_BIAS else None
    dd = tl.load(d_ptr + d, mask=d_mask, other=0.0).to(tl.float32) if HAS_D else None
    if HAS_DLAST:
        w = tl.load(dlast_ptr + b * dim * dstate + state_offs, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    da_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dc_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dd_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # (batch, groups, blocks, dstate, seqlen) offsets of this program's per-step dB / dC partials
    bc_base = ((b * tl.num_programs(1) + g) * tl.num_programs(2) + pid_j) * dstate * seqlen
    bc_offs = n[None, :] * seqlen
    steps = tl.arange(0, CHUNK)
    for i in range(0, n_chunks):
        k = n_chunks - 1 - i
        h0 = tl.load(ckpt_ptr + (b * n_chunks + k) * dim * dstate + state_offs, mask=dn_mask, other=0.0)
        t = (k * CHUNK + steps).to(tl.int64)
        t_mask = t < seqlen
        td_mask = t_mask[:, None] & d_mask[None, :]
        tn_mask = t_mask[:, None] & n_mask[None, :]
        u = tl.load(u_ptr + b * sub + d[None, :] * sud + t[:, None] * sul, mask=td_mask, other=0.0).to(tl.float32)
        raw, dl, decay = _decay(
            delta_ptr, bias, a, doc_ptr, b, d, d_mask, t, t_mask, sdb, sdd, sdl, sqb, HAS_BIAS, SOFTPLUS, HAS_DOC
        )
        bt = _bc(b_ptr, b, g, d, d_mask, n, n_mask, t, t_mask, sbb, sbg, sbn, sbl, B_CONST)
        ct = _bc(c_ptr, b, g, d, d_mask, n, n_mask, t, t_mask, scb, scg, scn, scl, C_CONST)
        inp = (dl * u)[:, :, None] * bt
        prod, acc = tl.associative_scan((decay, inp), 0, combine_steps)
        hs = prod * h0[None, :, :] + acc
        grad = tl.load(dout_ptr + b * sgb + d[None, :] * sgd + t[:, None] * sgl, mask=td_mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + b * szb + d[None, :] * szd + t[:, None] * szl, mask=td_mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            y = tl.sum(hs * ct, axis=2)
            if HAS_D:
                y += dd[None, :] * u
            tl.store(
                dz_ptr + b * dim * seqlen + d[None, :] * seqlen + t[:, None],
                (grad * y * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty),
                mask=td_mask,
            )
            grad = grad * z * sig
        if C_CONST:
            dc_acc += tl.sum(grad[:, :, None] * hs, axis=0)
        else:
            tl.store(dc_ptr + bc_base + bc_offs + t[:, None], tl.sum(grad[:, :, None] * hs, axis=1), mask=tn_mask)
        carried = hs - inp  # a_t h_{t-1}
        decay_first = _row(decay, steps, 0)
        # a_{t+1}, and 1 at the chunk's last step, where w brings the rest
        _, _, decay_next = _decay(
            delta_ptr,
            bias,
            a,
            doc_ptr,
            b,
            d,
            d_mask,
            t + 1,
            (t + 1 < seqlen) & (steps < CHUNK - 1),
            sdb,
            sdd,
            sdl,
            sqb,
            HAS_BIAS,
            SOFTPLUS,
            HAS_DOC,
        )
        prod, acc = tl.associative_scan((decay_next, grad[:, :, None] * ct), 0, combine_steps, reverse=True)
        dh = tl.where(t_mask[:, None, None], prod * w[None, :, :] + acc, 0.0)
        w = decay_first * _row(dh, steps, 0)
        dh_b = tl.sum(dh * bt, axis=2)
        du = dh_b * dl
        if HAS_D:
            du += dd[None, :] * grad
            dd_acc += tl.sum(grad * u, axis=0)
        tl.store(
            du_ptr + b * dim * seqlen + d[None, :] * seqlen + t[:, None], du.to(du_ptr.dtype.element_ty), mask=td_mask
        )
        dbu = dh * (dl * u)[:, :, None]
        if B_CONST:
            db_acc += tl.sum(dbu, axis=0)
        else:
            tl.store(db_ptr + bc_base + bc_offs + t[:, None], tl.sum(dbu, axis=1), mask=tn_mask)
        dexp = dh * carried
        da_acc += tl.sum(dexp * dl[:, :, None], axis=0)
        ddl = dh_b * u + tl.sum(dexp * a[None, :, :], axis=2)
        if SOFTPLUS:
            ddl = ddl * tl.sigmoid(raw)
        ddl = tl.where(td_mask, ddl, 0.0)
        tl.store(
            ddelta_ptr + b * dim * seqlen + d[None, :] * seqlen + t[:, None],
            ddl.to(ddelta_ptr.dtype.element_ty),
            mask=td_mask,
        )
        dbias_acc += tl.sum(ddl, axis=0)
    tl.store(da_ptr + b * dim * dstate + state_offs, da_acc, mask=dn_mask)
    if B_CONST:
        tl.store(db_ptr + b * dim * dstate + state_offs, db_acc, mask=dn_mask)
    if C_CONST:
        tl.store(dc_ptr + b * dim * dstate + state_offs, dc_acc, mask=dn_mask)
    if HAS_D:
        tl.store(dd_ptr + b * dim + d, dd_acc, mask=d_mask)
    if HAS_BIAS:
        tl.store(dbias_ptr + b * dim + d, dbias_acc, mask=d_mask)
    if HAS_INIT:
        tl.store(dinit_ptr + b * dim * dstate + state_offs, w, mask=dn_mask)
