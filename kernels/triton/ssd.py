"""Mamba-2 SSD scan in Triton: the chunked semi-separable algorithm, forward and backward.

Only within-chunk differences of cs = cumsum(dt*A) are exponentiated, masked ones set to -inf
first, so no decay overflows; the backward recomputes dt, cs and the states. The kernels'
formulas and the log-decay gradient's rounding: docs/code.md ("How the kernels compute").
"""

import torch
import triton
import triton.language as tl

from ..reference.ssd import _check
from . import common


@triton.jit
def _chunk_ids(pid, nheads, nchunks):
    """(batch, chunk, head) of a program over batch * nchunks * nheads, in 64 bits."""
    pid = pid.to(tl.int64)
    h = pid % nheads
    c = (pid // nheads) % nchunks
    b = pid // (nheads * nchunks)
    return b, c, h


@triton.jit
def _doc_bounds(doc_ptr, b, sdb, t0, clen):
    """Document counter of the position before the chunk (of position 0 for chunk 0) and of its last."""
    prev = tl.load(doc_ptr + b * sdb + tl.maximum(t0 - 1, 0))
    last = tl.load(doc_ptr + b * sdb + t0 + clen - 1)
    return prev, last


@triton.jit
def _dt_kernel(
    dt_ptr,
    bias_ptr,
    a_ptr,
    dtp_ptr,
    cs_ptr,
    seqlen,
    nheads,
    nchunks,
    chunk,
    sdtb,
    sdtl,
    sdth,
    dt_lo,
    dt_hi,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Processed dt and its within-chunk cumsum times A, (batch, nheads, nchunks, chunk) float32.

    Positions past the sequence end get dt = 0, so cs stays flat there.
    """
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    q = tl.arange(0, BLOCK_Q)
    t = c * chunk + q
    h_mask = h < nheads
    valid = h_mask[:, None] & ((q < chunk) & (t < seqlen))[None, :]
    v = tl.load(dt_ptr + b * sdtb + t[None, :] * sdtl + h[:, None] * sdth, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + h, mask=h_mask, other=0.0).to(tl.float32)[:, None]
    if SOFTPLUS:
        v = common.softplus(v)
    v = tl.minimum(tl.maximum(v, dt_lo), dt_hi)
    v = tl.where(valid, v, 0.0)
    a = tl.load(a_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
    cs = tl.cumsum(v * a[:, None], axis=1)
    offs = ((b * nheads + h[:, None]) * nchunks + c) * chunk + q[None, :]
    store_mask = h_mask[:, None] & (q < chunk)[None, :]
    tl.store(dtp_ptr + offs, v, mask=store_mask)
    tl.store(cs_ptr + offs, cs, mask=store_mask)


@triton.jit
def _chunk_state_kernel(
    x_ptr,
    w_ptr,
    dtp_ptr,
    cs_ptr,
    doc_ptr,
    out_ptr,
    seqlen,
    nheads,
    heads_per_group,
    nchunks,
    chunk,
    headdim,
    dstate,
    sxb,
    sxl,
    sxh,
    sxp,
    swb,
    swl,
    swg,
    swn,
    sdb,
    MODE: tl.constexpr,
    HAS_DOC: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[b, c, h] (headdim, dstate) float32 = sum_{s in chunk c} scale_s X_s^T W_s.

    MODE 0 (a chunk's end state): X = x, W = B, scale_s = dt_s exp(cs_last - cs_s), for s in
    the chunk's last document. MODE 1 (gradient of the entering state): X = dy, W = C,
    scale_s = exp(cs_s), for s in the document the entering state belongs to.
    """
    b, c, h = _chunk_ids(tl.program_id(0), nheads, nchunks)
    g = h // heads_per_group
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < dstate
    t0 = c * chunk
    clen = tl.minimum(chunk, seqlen - t0)
    cs_base = ((b * nheads + h) * nchunks + c) * chunk
    cs_last = tl.load(cs_ptr + cs_base + chunk - 1)
    if HAS_DOC:
        doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, clen)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, clen, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        s_mask = s < clen
        cs_s = tl.load(cs_ptr + cs_base + s, mask=s_mask, other=0.0)
        if MODE == 0:
            keep = s_mask
            if HAS_DOC:
                keep = keep & (tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-1) == doc_last)
            dt_s = tl.load(dtp_ptr + cs_base + s, mask=s_mask, other=0.0)
            scale = tl.exp(tl.where(keep, cs_last - cs_s, float("-inf"))) * dt_s
        else:
            keep = s_mask
            if HAS_DOC:
                keep = keep & (tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-1) == doc_prev)
            scale = tl.exp(tl.where(keep, cs_s, float("-inf")))
        xt = tl.load(
            x_ptr + b * sxb + (t0 + s)[None, :] * sxl + h * sxh + p[:, None] * sxp,
            mask=p_mask[:, None] & s_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + b * swb + (t0 + s)[:, None] * swl + g * swg + n[None, :] * swn,
            mask=s_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += tl.dot((xt.to(tl.float32) * scale[None, :]).to(w.dtype), w, input_precision=PREC)
    out = out_ptr + ((b * nchunks + c) * nheads + h) * headdim * dstate
    tl.store(out + p[:, None] * dstate + n[None, :], acc, mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def _state_pass_kernel(
    states_ptr,
    cs_ptr,
    init_ptr,
    doc_ptr,
    entering_ptr,
    final_ptr,
    seqlen,
    nheads,
    nchunks,
    chunk,
    size,
    sdb,
    HAS_INIT: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """entering[b, c, h] = the state entering chunk c; final[b, h] = the state after the last chunk.

    A state survives chunk c (decayed by exp(cs_last)) only if no document starts inside it.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    e_mask = e < size
    if HAS_INIT:
        state = tl.load(init_ptr + (b * nheads + h) * size + e, mask=e_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, nchunks):
        offs = ((b * nchunks + c) * nheads + h) * size + e
        tl.store(entering_ptr + offs, state, mask=e_mask)
        decay = tl.exp(tl.load(cs_ptr + ((b * nheads + h) * nchunks + c) * chunk + chunk - 1))
        if HAS_DOC:
            t0 = c * chunk
            doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, tl.minimum(chunk, seqlen - t0))
            decay = tl.where(doc_prev == doc_last, decay, 0.0)
        state = decay * state + tl.load(states_ptr + offs, mask=e_mask, other=0.0)
    tl.store(final_ptr + (b * nheads + h) * size + e, state, mask=e_mask)


@triton.jit
def _chunk_scan_kernel(
    x_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dtp_ptr,
    cs_ptr,
    entering_ptr,
    doc_ptr,
    out_ptr,
    seqlen,
    nheads,
    heads_per_group,
    nchunks,
    chunk,
    headdim,
    dstate,
    sxb,
    sxl,
    sxh,
    sxp,
    szb,
    szl,
    szh,
    szp,
    sbb,
    sbl,
    sbg,
    sbn,
    scb,
    scl,
    scg,
    scn,
    sob,
    sol,
    soh,
    sop,
    sdb,
    HAS_D: tl.constexpr,
    D_PER_CHANNEL: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DOC: tl.constexpr,
    PRE_GATE: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Output rows [BLOCK_M] x channels [BLOCK_P] of chunk c, head h; PRE_GATE (for the
    backward's gate gradient): the output before the gate, scan + D x, in out's dtype."""
    b, c, h = _chunk_ids(tl.program_id(0), nheads, nchunks)
    g = h // heads_per_group
    pid_m = tl.program_id(1)
    l_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    t0 = c * chunk
    clen = tl.minimum(chunk, seqlen - t0)
    l_mask = l_idx < clen
    p_mask = p < headdim
    n_mask = n < dstate
    cs_base = ((b * nheads + h) * nchunks + c) * chunk
    cs_l = tl.load(cs_ptr + cs_base + l_idx, mask=l_mask, other=0.0)
    cl = tl.load(
        c_ptr + b * scb + (t0 + l_idx)[:, None] * scl + g * scg + n[None, :] * scn,
        mask=l_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    enter = tl.load(
        entering_ptr + ((b * nchunks + c) * nheads + h) * headdim * dstate + p[None, :] * dstate + n[:, None],
        mask=n_mask[:, None] & p_mask[None, :],
        other=0.0,
    )
    from_start = l_mask
    if HAS_DOC:
        doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, clen)
        doc_l = tl.load(doc_ptr + b * sdb + t0 + l_idx, mask=l_mask, other=-1)
        from_start = from_start & (doc_l == doc_prev)
    scale_l = tl.exp(tl.where(from_start, cs_l, float("-inf")))
    acc = tl.dot(cl, enter.to(cl.dtype), input_precision=PREC) * scale_l[:, None]
    hi = tl.minimum((pid_m + 1) * BLOCK_M, clen)
    for k0 in range(0, hi, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        s_mask = s < clen
        bs = tl.load(
            b_ptr + b * sbb + (t0 + s)[None, :] * sbl + g * sbg + n[:, None] * sbn,
            mask=n_mask[:, None] & s_mask[None, :],
            other=0.0,
        )
        cb = tl.dot(cl, bs, input_precision=PREC)
        cs_s = tl.load(cs_ptr + cs_base + s, mask=s_mask, other=0.0)
        dt_s = tl.load(dtp_ptr + cs_base + s, mask=s_mask, other=0.0)
        keep = (s[None, :] <= l_idx[:, None]) & s_mask[None, :]
        if HAS_DOC:
            doc_s = tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-2)
            keep = keep & (doc_s[None, :] == doc_l[:, None])
        cb = cb * tl.exp(tl.where(keep, cs_l[:, None] - cs_s[None, :], float("-inf"))) * dt_s[None, :]
        xs = tl.load(
            x_ptr + b * sxb + (t0 + s)[:, None] * sxl + h * sxh + p[None, :] * sxp,
            mask=s_mask[:, None] & p_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(cb.to(xs.dtype), xs, input_precision=PREC)
    tile_mask = l_mask[:, None] & p_mask[None, :]
    if HAS_D:
        xl = tl.load(
            x_ptr + b * sxb + (t0 + l_idx)[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=tile_mask, other=0.0
        ).to(tl.float32)
        if D_PER_CHANNEL:
            dd = tl.load(d_ptr + h * headdim + p, mask=p_mask, other=0.0).to(tl.float32)
            acc += xl * dd[None, :]
        else:
            acc += xl * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z and not PRE_GATE:
        zl = tl.load(
            z_ptr + b * szb + (t0 + l_idx)[:, None] * szl + h * szh + p[None, :] * szp, mask=tile_mask, other=0.0
        ).to(tl.float32)
        acc = acc * zl * tl.sigmoid(zl)
    tl.store(
        out_ptr + b * sob + (t0 + l_idx)[:, None] * sol + h * soh + p[None, :] * sop,
        acc.to(out_ptr.dtype.element_ty),
        mask=tile_mask,
    )


@triton.jit
def _gate_bwd_kernel(
    dout_ptr,
    pre_ptr,
    x_ptr,
    z_ptr,
    dy_ptr,
    dz_ptr,
    dd_ptr,
    seqlen,
    nheads,
    headdim,
    sxb,
    sxl,
    sxh,
    sxp,
    szb,
    szl,
    szh,
    szp,
    sgb,
    sgl,
    sgh,
    sgp,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """From the gradient of out = pre * silu(z), pre = scan + D x (or out = pre without z): dy,
    the gradient of the scan (float32), dz and dD partials (row b * n_time_blocks + block, head,
    channel). pre, dy and dz are contiguous (batch, seqlen, nheads, headdim); dout has strides sg*.
    """
    b = tl.program_id(0).to(tl.int64)
    pid_l = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    t = pid_l.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    p = tl.arange(0, BLOCK_P)
    t_mask = t < seqlen
    p_mask = p < headdim
    mask = t_mask[:, None] & p_mask[None, :]
    offs = ((b * seqlen + t[:, None]) * nheads + h) * headdim + p[None, :]
    dy = tl.load(dout_ptr + b * sgb + t[:, None] * sgl + h * sgh + p[None, :] * sgp, mask=mask, other=0.0).to(
        tl.float32
    )
    x = tl.load(x_ptr + b * sxb + t[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        pre = tl.load(pre_ptr + offs, mask=mask, other=0.0)
        z = tl.load(z_ptr + b * szb + t[:, None] * szl + h * szh + p[None, :] * szp, mask=mask, other=0.0).to(
            tl.float32
        )
        sig = tl.sigmoid(z)
        tl.store(dz_ptr + offs, (dy * pre * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)
        dy = dy * z * sig
    tl.store(dy_ptr + offs, dy, mask=mask)
    if HAS_D:
        row = b * tl.num_programs(1) + pid_l
        tl.store(dd_ptr + (row * nheads + h) * headdim + p, tl.sum(dy * x, axis=0), mask=p_mask)


@triton.jit
def _state_pass_bwd_kernel(
    cs_ptr,
    doc_ptr,
    entering_ptr,
    dfinal_ptr,
    dout_states_ptr,
    dstates_ptr,
    dinit_ptr,
    sdot_ptr,
    seqlen,
    nheads,
    nchunks,
    chunk,
    size,
    sdb,
    HAS_DFINAL: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Reverse state passing. dstates[b, c, h] = dS_{c+1} (the gradient of chunk c's own end
    state), dinit = dS_0, sdot[b, h, c, block] = partial exp(cs_last) <dS_{c+1}, S_c> (the gradient
    of the chunk's total log-decay through the state that crosses it).

    dS_c = (gradient from chunk c's outputs) + exp(cs_last of c) dS_{c+1} if the state survives c.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid_e = tl.program_id(2)
    e = pid_e * BLOCK + tl.arange(0, BLOCK)
    e_mask = e < size
    if HAS_DFINAL:
        dnext = tl.load(dfinal_ptr + (b * nheads + h) * size + e, mask=e_mask, other=0.0).to(tl.float32)
    else:
        dnext = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, nchunks):
        c = nchunks - 1 - i
        offs = ((b * nchunks + c) * nheads + h) * size + e
        tl.store(dstates_ptr + offs, dnext, mask=e_mask)
        decay = tl.exp(tl.load(cs_ptr + ((b * nheads + h) * nchunks + c) * chunk + chunk - 1))
        if HAS_DOC:
            t0 = c * chunk
            doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, tl.minimum(chunk, seqlen - t0))
            decay = tl.where(doc_prev == doc_last, decay, 0.0)
        enter = tl.load(entering_ptr + offs, mask=e_mask, other=0.0)
        tl.store(
            sdot_ptr + ((b * nheads + h) * nchunks + c) * tl.num_programs(2) + pid_e,
            decay * tl.sum(dnext * enter, axis=0),
        )
        dnext = tl.load(dout_states_ptr + offs, mask=e_mask, other=0.0) + decay * dnext
    tl.store(dinit_ptr + (b * nheads + h) * size + e, dnext, mask=e_mask)


@triton.jit
def _dx_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dtp_ptr,
    cs_ptr,
    doc_ptr,
    dy_ptr,
    dstates_ptr,
    dx_ptr,
    ddt_ptr,
    wstate_ptr,
    seqlen,
    nheads,
    heads_per_group,
    nchunks,
    chunk,
    headdim,
    dstate,
    sxb,
    sxl,
    sxh,
    sxp,
    sbb,
    sbl,
    sbg,
    sbn,
    scb,
    scl,
    scg,
    scn,
    sdb,
    HAS_D: tl.constexpr,
    D_PER_CHANNEL: tl.constexpr,
    HAS_DOC: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_N: tl.constexpr,
):
    """dx for rows s of chunk c, head h: dt_s (g_state + g_diag + g_intra) + D dy_s with
    g_state = exp(cs_last - cs_s) B_s dS_{c+1}^T, g_diag = (B_s.C_s) dy_s and
    g_intra = sum_{l>s} (B_s.C_l) exp(cs_l - cs_s) dy_l.
    Also, in the (batch, nheads, nchunks, chunk) layout: ddt_s (direct part) = x_s . (sum of g)
    and wstate_s = dt_s x_s . g_state (the chunk's end state's share of the log-decay gradient).
    dx, dy: contiguous (b, seqlen, h, p).
    The products over dstate run in slices of SLICE_N states (float32 dots, done with FMAs, spill
    on sm_90 when they hold all 128 states' operands at once)."""
    b, c, h = _chunk_ids(tl.program_id(0), nheads, nchunks)
    g = h // heads_per_group
    s = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, SLICE_N)
    t0 = c * chunk
    clen = tl.minimum(chunk, seqlen - t0)
    s_mask = s < clen
    p_mask = p < headdim
    tile_mask = s_mask[:, None] & p_mask[None, :]
    cs_base = ((b * nheads + h) * nchunks + c) * chunk
    cs_s = tl.load(cs_ptr + cs_base + s, mask=s_mask, other=0.0)
    cs_last = tl.load(cs_ptr + cs_base + chunk - 1)
    to_end = s_mask
    if HAS_DOC:
        doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, clen)
        doc_s = tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-1)
        to_end = to_end & (doc_s == doc_last)
    g_state = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    bc_diag = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, BLOCK_N, SLICE_N):
        n_mask = n0 + n < dstate
        sn_mask = s_mask[:, None] & n_mask[None, :]
        bs = tl.load(
            b_ptr + b * sbb + (t0 + s)[:, None] * sbl + g * sbg + (n0 + n)[None, :] * sbn, mask=sn_mask, other=0.0
        )
        dst = tl.load(
            dstates_ptr + ((b * nchunks + c) * nheads + h) * headdim * dstate + p[None, :] * dstate + (n0 + n)[:, None],
            mask=n_mask[:, None] & p_mask[None, :],
            other=0.0,
        )
        g_state += tl.dot(bs, dst.to(bs.dtype), input_precision=PREC)
        cs_rows = tl.load(
            c_ptr + b * scb + (t0 + s)[:, None] * scl + g * scg + (n0 + n)[None, :] * scn, mask=sn_mask, other=0.0
        )
        bc_diag += tl.sum(bs.to(tl.float32) * cs_rows.to(tl.float32), axis=1)
    g_state = g_state * tl.exp(tl.where(to_end, cs_last - cs_s, float("-inf")))[:, None]
    g_intra = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for k0 in range(tl.program_id(1) * BLOCK_M, clen, BLOCK_K):
        l_idx = k0 + tl.arange(0, BLOCK_K)
        l_mask = l_idx < clen
        bc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, BLOCK_N, SLICE_N):
            n_mask = n0 + n < dstate
            bs = tl.load(
                b_ptr + b * sbb + (t0 + s)[:, None] * sbl + g * sbg + (n0 + n)[None, :] * sbn,
                mask=s_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            cl = tl.load(
                c_ptr + b * scb + (t0 + l_idx)[None, :] * scl + g * scg + (n0 + n)[:, None] * scn,
                mask=n_mask[:, None] & l_mask[None, :],
                other=0.0,
            )
            bc += tl.dot(bs, cl, input_precision=PREC)
        cs_l = tl.load(cs_ptr + cs_base + l_idx, mask=l_mask, other=0.0)
        keep = (l_idx[None, :] > s[:, None]) & l_mask[None, :]
        if HAS_DOC:
            doc_l = tl.load(doc_ptr + b * sdb + t0 + l_idx, mask=l_mask, other=-2)
            keep = keep & (doc_l[None, :] == doc_s[:, None])
        bc = bc * tl.exp(tl.where(keep, cs_l[None, :] - cs_s[:, None], float("-inf")))
        dyl = tl.load(
            dy_ptr + ((b * seqlen + t0 + l_idx[:, None]) * nheads + h) * headdim + p[None, :],
            mask=l_mask[:, None] & p_mask[None, :],
            other=0.0,
        )
        g_intra += tl.dot(bc.to(b_ptr.dtype.element_ty), dyl.to(b_ptr.dtype.element_ty), input_precision=PREC)
    dys = tl.load(
        dy_ptr + ((b * seqlen + t0 + s[:, None]) * nheads + h) * headdim + p[None, :], mask=tile_mask, other=0.0
    )
    g_diag = bc_diag[:, None] * dys
    xs = tl.load(x_ptr + b * sxb + (t0 + s)[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=tile_mask, other=0.0).to(
        tl.float32
    )
    dt_s = tl.load(dtp_ptr + cs_base + s, mask=s_mask, other=0.0)
    grad = g_state + g_diag + g_intra
    tl.store(ddt_ptr + cs_base + s, tl.sum(grad * xs, axis=1), mask=s_mask)
    tl.store(wstate_ptr + cs_base + s, dt_s * tl.sum(g_state * xs, axis=1), mask=s_mask)
    dx = grad * dt_s[:, None]
    if HAS_D:
        if D_PER_CHANNEL:
            dx += dys * tl.load(d_ptr + h * headdim + p, mask=p_mask, other=0.0).to(tl.float32)[None, :]
        else:
            dx += dys * tl.load(d_ptr + h).to(tl.float32)
    tl.store(
        dx_ptr + ((b * seqlen + t0 + s[:, None]) * nheads + h) * headdim + p[None, :],
        dx.to(dx_ptr.dtype.element_ty),
        mask=tile_mask,
    )


@triton.jit
def _dlogdecay_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    dtp_ptr,
    cs_ptr,
    doc_ptr,
    dy_ptr,
    entering_ptr,
    part_ptr,
    seqlen,
    nheads,
    heads_per_group,
    nchunks,
    chunk,
    headdim,
    dstate,
    sxb,
    sxl,
    sxh,
    sxp,
    sbb,
    sbl,
    sbg,
    sbn,
    scb,
    scl,
    scg,
    scn,
    sdb,
    HAS_DOC: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE_P: tl.constexpr,
    SLICE_N: tl.constexpr,
):
    """The log-decay gradient through the outputs of rows l of chunk c, head h, as one sum over the
    output pairs each step separates (not a difference of two larger sums). a_t = dt_t A moves cs_l - cs_s
    for s < t <= l, and cs_l for t <= l, so with M[l, s] = (dy_l.x_s)(C_l.B_s) exp(cs_l - cs_s) dt_s
    (s < l, one document) and ystate_l = exp(cs_l) dy_l.(C_l S_c):

        part[t] = sum_{l in the block, l >= t} (ystate_l + sum_{s < t} M[l, s])

    for t before the block's end (row prefix sums over s, a running carry across tiles of s),
    in the (batch, nheads, nchunks, row block, chunk) layout. Products over headdim and dstate run
    in slices of SLICE_P and SLICE_N (float32 dots, done with FMAs, spill on sm_90 otherwise)."""
    b, c, h = _chunk_ids(tl.program_id(0), nheads, nchunks)
    g = h // heads_per_group
    pid_m = tl.program_id(1)
    l_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, SLICE_P)
    n = tl.arange(0, SLICE_N)
    t0 = c * chunk
    clen = tl.minimum(chunk, seqlen - t0)
    l_mask = l_idx < clen
    cs_base = ((b * nheads + h) * nchunks + c) * chunk
    cs_l = tl.load(cs_ptr + cs_base + l_idx, mask=l_mask, other=0.0)
    from_start = l_mask
    if HAS_DOC:
        doc_prev, _ = _doc_bounds(doc_ptr, b, sdb, t0, clen)
        doc_l = tl.load(doc_ptr + b * sdb + t0 + l_idx, mask=l_mask, other=-1)
        from_start = from_start & (doc_l == doc_prev)
    dy_rows = dy_ptr + ((b * seqlen + t0 + l_idx[:, None]) * nheads + h) * headdim
    enter_base = entering_ptr + ((b * nchunks + c) * nheads + h) * headdim * dstate
    ystate = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, BLOCK_N, SLICE_N):
        n_mask = n0 + n < dstate
        dy_s = tl.zeros((BLOCK_M, SLICE_N), dtype=tl.float32)
        for p0 in range(0, BLOCK_P, SLICE_P):
            p_mask = p0 + p < headdim
            dyl = tl.load(dy_rows + (p0 + p)[None, :], mask=l_mask[:, None] & p_mask[None, :], other=0.0)
            enter = tl.load(
                enter_base + (p0 + p)[:, None] * dstate + (n0 + n)[None, :],
                mask=p_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            dy_s += tl.dot(dyl.to(x_ptr.dtype.element_ty), enter.to(x_ptr.dtype.element_ty), input_precision=PREC)
        cl = tl.load(
            c_ptr + b * scb + (t0 + l_idx)[:, None] * scl + g * scg + (n0 + n)[None, :] * scn,
            mask=l_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        ystate += tl.sum(dy_s * cl.to(tl.float32), axis=1)
    ystate = ystate * tl.exp(tl.where(from_start, cs_l, float("-inf")))
    carry = tl.zeros((BLOCK_M,), dtype=tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, clen)
    part = part_ptr + (((b * nheads + h) * nchunks + c) * tl.num_programs(1) + pid_m) * chunk
    for k0 in range(0, hi, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        s_mask = s < clen
        m = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for p0 in range(0, BLOCK_P, SLICE_P):
            p_mask = p0 + p < headdim
            dyl = tl.load(dy_rows + (p0 + p)[None, :], mask=l_mask[:, None] & p_mask[None, :], other=0.0)
            xst = tl.load(
                x_ptr + b * sxb + (t0 + s)[None, :] * sxl + h * sxh + (p0 + p)[:, None] * sxp,
                mask=p_mask[:, None] & s_mask[None, :],
                other=0.0,
            )
            m += tl.dot(dyl.to(x_ptr.dtype.element_ty), xst, input_precision=PREC)
        cb = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, BLOCK_N, SLICE_N):
            n_mask = n0 + n < dstate
            cl = tl.load(
                c_ptr + b * scb + (t0 + l_idx)[:, None] * scl + g * scg + (n0 + n)[None, :] * scn,
                mask=l_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            bst = tl.load(
                b_ptr + b * sbb + (t0 + s)[None, :] * sbl + g * sbg + (n0 + n)[:, None] * sbn,
                mask=n_mask[:, None] & s_mask[None, :],
                other=0.0,
            )
            cb += tl.dot(cl, bst, input_precision=PREC)
        cs_s = tl.load(cs_ptr + cs_base + s, mask=s_mask, other=0.0)
        dt_s = tl.load(dtp_ptr + cs_base + s, mask=s_mask, other=0.0)
        keep = (s[None, :] < l_idx[:, None]) & s_mask[None, :] & l_mask[:, None]
        if HAS_DOC:
            doc_s = tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-2)
            keep = keep & (doc_s[None, :] == doc_l[:, None])
        m = m * cb * tl.exp(tl.where(keep, cs_l[:, None] - cs_s[None, :], float("-inf"))) * dt_s[None, :]
        before = carry[:, None] + tl.cumsum(m, axis=1) - m
        reaches = (l_idx[:, None] >= s[None, :]) & l_mask[:, None]
        tl.store(part + s, tl.sum(tl.where(reaches, before + ystate[:, None], 0.0), axis=0), mask=s < hi)
        carry += tl.sum(m, axis=1)


@triton.jit
def _dbc_kernel(
    x_ptr,
    w_ptr,
    dtp_ptr,
    cs_ptr,
    doc_ptr,
    dy_ptr,
    state_ptr,
    out_ptr,
    seqlen,
    nheads,
    heads_per_group,
    nchunks,
    chunk,
    headdim,
    dstate,
    sxb,
    sxl,
    sxh,
    sxp,
    swb,
    swl,
    swg,
    swn,
    sdb,
    GRAD_C: tl.constexpr,
    HAS_DOC: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dC (GRAD_C) or dB for rows r of chunk c, group g, summed over the group's heads:
    dC_r = exp(cs_r) dy_r S_c + sum_{s<=r} (dy_r.x_s) exp(cs_r - cs_s) dt_s B_s
    dB_r = dt_r exp(cs_last - cs_r) x_r dS_{c+1} + sum_{l>=r} (dy_l.x_r) exp(cs_l - cs_r) dt_r C_l
    w is B (for dC) or C (for dB), state the entering states S_c or their gradients dS_{c+1}.
    One gradient per launch: both in one program hold two accumulators and spill on sm_90.
    The output is contiguous (batch, seqlen, ngroups, dstate)."""
    pid = tl.program_id(0).to(tl.int64)
    ngroups = nheads // heads_per_group
    g = pid % ngroups
    c = (pid // ngroups) % nchunks
    b = pid // (ngroups * nchunks)
    pid_m = tl.program_id(1)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    t0 = c * chunk
    clen = tl.minimum(chunk, seqlen - t0)
    r_mask = r < clen
    p_mask = p < headdim
    n_mask = n < dstate
    rp_mask = r_mask[:, None] & p_mask[None, :]
    if HAS_DOC:
        doc_prev, doc_last = _doc_bounds(doc_ptr, b, sdb, t0, clen)
        doc_r = tl.load(doc_ptr + b * sdb + t0 + r, mask=r_mask, other=-1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for hh in range(0, heads_per_group):
        h = g * heads_per_group + hh
        cs_base = ((b * nheads + h) * nchunks + c) * chunk
        cs_r = tl.load(cs_ptr + cs_base + r, mask=r_mask, other=0.0)
        state = tl.load(
            state_ptr + ((b * nchunks + c) * nheads + h) * headdim * dstate + p[:, None] * dstate + n[None, :],
            mask=p_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if GRAD_C:
            dyr = tl.load(
                dy_ptr + ((b * seqlen + t0 + r[:, None]) * nheads + h) * headdim + p[None, :], mask=rp_mask, other=0.0
            ).to(x_ptr.dtype.element_ty)
            from_start = r_mask
            if HAS_DOC:
                from_start = from_start & (doc_r == doc_prev)
            acc += (
                tl.dot(dyr, state.to(dyr.dtype), input_precision=PREC)
                * tl.exp(tl.where(from_start, cs_r, float("-inf")))[:, None]
            )
            for k0 in range(0, tl.minimum((pid_m + 1) * BLOCK_M, clen), BLOCK_K):
                s = k0 + tl.arange(0, BLOCK_K)
                s_mask = s < clen
                xst = tl.load(
                    x_ptr + b * sxb + (t0 + s)[None, :] * sxl + h * sxh + p[:, None] * sxp,
                    mask=p_mask[:, None] & s_mask[None, :],
                    other=0.0,
                )
                m = tl.dot(dyr, xst, input_precision=PREC)
                cs_s = tl.load(cs_ptr + cs_base + s, mask=s_mask, other=0.0)
                dt_s = tl.load(dtp_ptr + cs_base + s, mask=s_mask, other=0.0)
                keep = (s[None, :] <= r[:, None]) & s_mask[None, :]
                if HAS_DOC:
                    doc_s = tl.load(doc_ptr + b * sdb + t0 + s, mask=s_mask, other=-2)
                    keep = keep & (doc_s[None, :] == doc_r[:, None])
                m = m * tl.exp(tl.where(keep, cs_r[:, None] - cs_s[None, :], float("-inf"))) * dt_s[None, :]
                bs = tl.load(
                    w_ptr + b * swb + (t0 + s)[:, None] * swl + g * swg + n[None, :] * swn,
                    mask=s_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )
                acc += tl.dot(m.to(bs.dtype), bs, input_precision=PREC)
        else:
            xr = tl.load(
                x_ptr + b * sxb + (t0 + r)[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=rp_mask, other=0.0
            )
            dt_r = tl.load(dtp_ptr + cs_base + r, mask=r_mask, other=0.0)
            cs_last = tl.load(cs_ptr + cs_base + chunk - 1)
            to_end = r_mask
            if HAS_DOC:
                to_end = to_end & (doc_r == doc_last)
            acc += (
                tl.dot(xr, state.to(xr.dtype), input_precision=PREC)
                * (tl.exp(tl.where(to_end, cs_last - cs_r, float("-inf"))) * dt_r)[:, None]
            )
            for k0 in range(pid_m * BLOCK_M, clen, BLOCK_K):
                l_idx = k0 + tl.arange(0, BLOCK_K)
                l_mask = l_idx < clen
                dylt = tl.load(
                    dy_ptr + ((b * seqlen + t0 + l_idx[None, :]) * nheads + h) * headdim + p[:, None],
                    mask=p_mask[:, None] & l_mask[None, :],
                    other=0.0,
                ).to(xr.dtype)
                m = tl.dot(xr, dylt, input_precision=PREC)
                cs_l = tl.load(cs_ptr + cs_base + l_idx, mask=l_mask, other=0.0)
                keep = (l_idx[None, :] >= r[:, None]) & l_mask[None, :]
                if HAS_DOC:
                    doc_l = tl.load(doc_ptr + b * sdb + t0 + l_idx, mask=l_mask, other=-2)
                    keep = keep & (doc_l[None, :] == doc_r[:, None])
                m = m * tl.exp(tl.where(keep, cs_l[None, :] - cs_r[:, None], float("-inf"))) * dt_r[:, None]
                cl = tl.load(
                    w_ptr + b * swb + (t0 + l_idx)[:, None] * swl + g * swg + n[None, :] * swn,
                    mask=l_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )
                acc += tl.dot(m.to(cl.dtype), cl, input_precision=PREC)
    tl.store(
        out_ptr + ((b * seqlen + t0 + r[:, None]) * ngroups + g) * dstate + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _dt_bwd_kernel(
    dt_ptr,
    bias_ptr,
    a_ptr,
    dtp_ptr,
    part_ptr,
    ddt_direct_ptr,
    wstate_ptr,
    sdot_ptr,
    ddt_ptr,
    da_ptr,
    dbias_ptr,
    dlog_ptr,
    seqlen,
    nheads,
    nchunks,
    chunk,
    row_blocks,
    rows,
    sdtb,
    sdtl,
    sdth,
    sgb,
    sgl,
    sgh,
    dt_lo,
    dt_hi,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    STORE_DLOG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The gradient of a_t = dt_t A (the log-decay of step t) from its three paths: the chunk's
    outputs (_dlogdecay_kernel's parts, one per block of `rows` rows), its end state
    (sum_{s<t} wstate_s) and the state crossing it (sdot_c); STORE_DLOG: stored into dlog like cs.
    Then ddt = direct + da * A, dA partials (b, c, head), and through clamp and softplus to d dt
    (strides sg*) and d dt_bias partials (b, c, head)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    q = tl.arange(0, BLOCK_Q)
    t = c * chunk + q
    h_mask = h < nheads
    valid = h_mask[:, None] & ((q < chunk) & (t < seqlen))[None, :]
    offs = ((b * nheads + h[:, None]) * nchunks + c) * chunk + q[None, :]
    da = tl.zeros((BLOCK_H, BLOCK_Q), dtype=tl.float32)
    parts = ((b * nheads + h[:, None]) * nchunks + c) * row_blocks * chunk + q[None, :]
    for j in range(0, row_blocks):
        da += tl.load(part_ptr + parts + j * chunk, mask=valid & (q < (j + 1) * rows)[None, :], other=0.0)
    before = valid & (q >= 1)[None, :]
    da += tl.cumsum(tl.load(wstate_ptr + offs - 1, mask=before, other=0.0), axis=1)
    da += tl.load(sdot_ptr + (b * nheads + h) * nchunks + c, mask=h_mask, other=0.0)[:, None]
    if STORE_DLOG:
        tl.store(dlog_ptr + offs, da, mask=valid)
    a = tl.load(a_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
    dtp = tl.load(dtp_ptr + offs, mask=valid, other=0.0)
    ddt = tl.load(ddt_direct_ptr + offs, mask=valid, other=0.0) + da * a[:, None]
    part = (b * nchunks + c) * nheads + h
    tl.store(da_ptr + part, tl.sum(tl.where(valid, da * dtp, 0.0), axis=1), mask=h_mask)
    v = tl.load(dt_ptr + b * sdtb + t[None, :] * sdtl + h[:, None] * sdth, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + h, mask=h_mask, other=0.0).to(tl.float32)[:, None]
    if SOFTPLUS:
        sp = common.softplus(v)
        ddt = tl.where((sp >= dt_lo) & (sp <= dt_hi), ddt, 0.0) * tl.sigmoid(v)
    else:
        ddt = tl.where((v >= dt_lo) & (v <= dt_hi), ddt, 0.0)
    ddt = tl.where(valid, ddt, 0.0)
    tl.store(ddt_ptr + b * sgb + t[None, :] * sgl + h[:, None] * sgh, ddt.to(ddt_ptr.dtype.element_ty), mask=valid)
    if HAS_BIAS:
        tl.store(dbias_ptr + part, tl.sum(ddt, axis=1), mask=h_mask)


class _Sizes:
    """Shapes and launch blocks of one call."""

    def __init__(self, x, B, chunk_size):
        self.batch, self.seqlen, self.nheads, self.headdim = x.shape
        self.ngroups, self.dstate = B.shape[2], B.shape[3]
        self.per_group = self.nheads // self.ngroups
        self.chunk = chunk_size
        self.nchunks = triton.cdiv(self.seqlen, chunk_size)
        self.block_q = common.block(chunk_size, lo=1)
        self.block_m = common.block(chunk_size, hi=64)
        self.block_p = common.block(self.headdim)
        self.block_n = common.block(self.dstate)
        self.state_size = self.headdim * self.dstate
        self.block_e = common.block(self.state_size, hi=1024)
        self.block_h = 8
        self.prec = common.dot_precision(x.dtype)
        # Kernels holding (BLOCK_M x dstate) float32 tiles get more warps to hold them.
        self.warps = 8 if self.block_m * self.block_n >= 64 * 128 else 4
        # Positions per inner step of the scan, dx and dB/dC kernels (and _dbc_kernel's rows):
        # steps of 64 spill in bf16 on sm_90 (and _dbc_kernel's rows of 64 even in 2 stages).
        # Pipeline stages that spill nothing on sm_90: float32 dots (FMA, no tensor cores) hold
        # other tiles than bf16 ones.
        self.block_k = common.block(chunk_size, hi=32)
        fp32 = x.dtype == torch.float32
        self.scan_stages, self.dbc_stages = (2, 3) if fp32 else (3, 2)
        self.slice_n = min(self.block_n, 32) if fp32 else self.block_n
        # _dlogdecay_kernel's headdim slices: 32 spilled 16 B in float32 without documents (Triton 3.6, sm_90).
        self.slice_p = min(self.block_p, 16) if fp32 else self.block_p

    def dims(self):
        return (self.seqlen, self.nheads, self.per_group, self.nchunks, self.chunk, self.headdim, self.dstate)


def _empty(shape, like, dtype=torch.float32):
    return common.empty(shape, device=like.device, dtype=dtype)


def _strides(t, n):
    return t.stride() if t is not None else (0,) * n


def _forward_states(sz, x, dt, A, B, dt_bias, initial_states, doc, dt_softplus, dt_limit):
    """dt, cs (batch, nheads, nchunks, chunk), entering states (batch, nchunks, nheads, p, n), final state."""
    dtp = _empty((sz.batch, sz.nheads, sz.nchunks, sz.chunk), x)
    cs = _empty(dtp.shape, x)
    _dt_kernel[(sz.batch, sz.nchunks, triton.cdiv(sz.nheads, sz.block_h))](
        dt,
        dt_bias,
        A,
        dtp,
        cs,
        sz.seqlen,
        sz.nheads,
        sz.nchunks,
        sz.chunk,
        *dt.stride(),
        float(dt_limit[0]),
        float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus,
        BLOCK_H=sz.block_h,
        BLOCK_Q=sz.block_q,
    )
    states = _empty((sz.batch, sz.nchunks, sz.nheads, sz.headdim, sz.dstate), x)
    _chunk_states(sz, x, B, dtp, cs, doc, states, mode=0)
    entering = _empty(states.shape, x)
    final = _empty((sz.batch, sz.nheads, sz.headdim, sz.dstate), x)
    _state_pass_kernel[(sz.batch, sz.nheads, triton.cdiv(sz.state_size, sz.block_e))](
        states,
        cs,
        initial_states,
        doc,
        entering,
        final,
        sz.seqlen,
        sz.nheads,
        sz.nchunks,
        sz.chunk,
        sz.state_size,
        doc.stride(0) if doc is not None else 0,
        HAS_INIT=initial_states is not None,
        HAS_DOC=doc is not None,
        BLOCK=sz.block_e,
    )
    return dtp, cs, states, entering, final


def _chunk_states(sz, xs, ws, dtp, cs, doc, out, mode):
    block_p = common.block(sz.headdim, hi=64)
    block_n = common.block(sz.dstate, hi=64)
    grid = (sz.batch * sz.nchunks * sz.nheads, triton.cdiv(sz.headdim, block_p), triton.cdiv(sz.dstate, block_n))
    _chunk_state_kernel[grid](
        xs,
        ws,
        dtp,
        cs,
        doc,
        out,
        sz.seqlen,
        sz.nheads,
        sz.per_group,
        sz.nchunks,
        sz.chunk,
        sz.headdim,
        sz.dstate,
        *xs.stride(),
        *ws.stride(),
        doc.stride(0) if doc is not None else 0,
        MODE=mode,
        HAS_DOC=doc is not None,
        PREC=sz.prec,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        BLOCK_K=sz.block_m,
    )


def _scan(sz, x, z, B, C, D, dtp, cs, entering, doc, out, pre_gate=False):
    """The scan output into `out`; pre_gate: before the gate (see _chunk_scan_kernel)."""
    block_p = common.block(sz.headdim, hi=64)
    grid = (sz.batch * sz.nchunks * sz.nheads, triton.cdiv(sz.chunk, sz.block_m), triton.cdiv(sz.headdim, block_p))
    _chunk_scan_kernel[grid](
        x,
        z,
        B,
        C,
        D,
        dtp,
        cs,
        entering,
        doc,
        out,
        *sz.dims(),
        *x.stride(),
        *_strides(z, 4),
        *B.stride(),
        *C.stride(),
        *out.stride(),
        doc.stride(0) if doc is not None else 0,
        HAS_D=D is not None,
        D_PER_CHANNEL=D is not None and D.dim() == 2,
        HAS_Z=z is not None,
        HAS_DOC=doc is not None,
        PRE_GATE=pre_gate,
        PREC=sz.prec,
        BLOCK_M=sz.block_m,
        BLOCK_K=sz.block_k,
        BLOCK_P=block_p,
        BLOCK_N=sz.block_n,
        num_warps=sz.warps,
        num_stages=sz.scan_stages,
    )


def _check_sizes(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states):
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    if B.shape[3] > 256:
        raise ValueError(f"dstate must be at most 256 for the Triton kernel, got {B.shape[3]}")
    if x.shape[3] > 256:
        raise ValueError(f"headdim must be at most 256 for the Triton kernel, got {x.shape[3]}")


def forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit):
    """(y in x's dtype, the final states (batch, nheads, headdim, dstate) float32), both contiguous."""
    _check_sizes(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    doc = common.document_counters(seq_idx, x.shape[0], x.shape[1])
    sz = _Sizes(x, B, chunk_size)
    dtp, cs, _, entering, final = _forward_states(sz, x, dt, A, B, dt_bias, initial_states, doc, dt_softplus, dt_limit)
    out = _empty(x.shape, x, x.dtype)
    _scan(sz, x, z, B, C, D, dtp, cs, entering, doc, out)
    return out, final


def backward(
    dout,
    dfinal,
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
    dt_limit,
    log_decay_grad=None,
):
    """(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states), None for an absent input; dfinal None
    when the final states are unused. log_decay_grad, a float32 (batch, nheads, nchunks, chunk) tensor,
    receives the gradient of each step's log-decay dt A at each position of the sequence, which ddt mixes with
    that of dt as the input's scale (Mamba-3 reads them apart: kernels/triton/mamba3.py)."""
    doc = common.document_counters(seq_idx, x.shape[0], x.shape[1])
    dfinal = dfinal.contiguous() if dfinal is not None else None  # read as (batch, nheads, headdim, dstate)
    sz = _Sizes(x, B, chunk_size)
    sdb = doc.stride(0) if doc is not None else 0
    dtp, cs, states, entering, _ = _forward_states(sz, x, dt, A, B, dt_bias, initial_states, doc, dt_softplus, dt_limit)
    pre = None
    if z is not None:
        pre = _empty(x.shape, x)
        _scan(sz, x, z, B, C, D, dtp, cs, entering, doc, pre, pre_gate=True)
    block_l = 32
    n_lblocks = triton.cdiv(sz.seqlen, block_l)
    dy = _empty(x.shape, x)
    dz = _empty(z.shape, z, z.dtype) if z is not None else None
    dd_part = _empty((sz.batch * n_lblocks, sz.nheads, sz.headdim), x) if D is not None else None
    _gate_bwd_kernel[(sz.batch, n_lblocks, sz.nheads)](
        dout,
        pre,
        x,
        z,
        dy,
        dz,
        dd_part,
        sz.seqlen,
        sz.nheads,
        sz.headdim,
        *x.stride(),
        *_strides(z, 4),
        *dout.stride(),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        BLOCK_L=block_l,
        BLOCK_P=sz.block_p,
    )
    del pre

    dout_states = _empty(states.shape, x)
    _chunk_states(sz, dy, C, dtp, cs, doc, dout_states, mode=1)
    dstates = _empty(states.shape, x)
    dinit = _empty((sz.batch, sz.nheads, sz.headdim, sz.dstate), x)
    n_eblocks = triton.cdiv(sz.state_size, sz.block_e)
    sdot_part = _empty((sz.batch, sz.nheads, sz.nchunks, n_eblocks), x)
    _state_pass_bwd_kernel[(sz.batch, sz.nheads, n_eblocks)](
        cs,
        doc,
        entering,
        dfinal,
        dout_states,
        dstates,
        dinit,
        sdot_part,
        sz.seqlen,
        sz.nheads,
        sz.nchunks,
        sz.chunk,
        sz.state_size,
        sdb,
        HAS_DFINAL=dfinal is not None,
        HAS_DOC=doc is not None,
        BLOCK=sz.block_e,
    )
    del dout_states

    dx = _empty(x.shape, x, x.dtype)
    ddt_direct = _empty(dtp.shape, x)
    wstate = _empty(dtp.shape, x)
    grid = (sz.batch * sz.nchunks * sz.nheads, triton.cdiv(sz.chunk, sz.block_m))
    _dx_kernel[grid](
        x,
        B,
        C,
        D,
        dtp,
        cs,
        doc,
        dy,
        dstates,
        dx,
        ddt_direct,
        wstate,
        *sz.dims(),
        *x.stride(),
        *B.stride(),
        *C.stride(),
        sdb,
        HAS_D=D is not None,
        D_PER_CHANNEL=D is not None and D.dim() == 2,
        HAS_DOC=doc is not None,
        PREC=sz.prec,
        BLOCK_M=sz.block_m,
        BLOCK_K=sz.block_k,
        BLOCK_P=sz.block_p,
        BLOCK_N=sz.block_n,
        SLICE_N=sz.slice_n,
        num_warps=sz.warps,
    )

    row_blocks = triton.cdiv(sz.chunk, sz.block_m)
    dlogdecay_parts = _empty((sz.batch, sz.nheads, sz.nchunks, row_blocks, sz.chunk), x)
    _dlogdecay_kernel[(sz.batch * sz.nchunks * sz.nheads, row_blocks)](
        x,
        B,
        C,
        dtp,
        cs,
        doc,
        dy,
        entering,
        dlogdecay_parts,
        *sz.dims(),
        *x.stride(),
        *B.stride(),
        *C.stride(),
        sdb,
        HAS_DOC=doc is not None,
        PREC=sz.prec,
        BLOCK_M=sz.block_m,
        BLOCK_K=sz.block_k,
        BLOCK_P=sz.block_p,
        BLOCK_N=sz.block_n,
        SLICE_P=sz.slice_p,
        SLICE_N=sz.slice_n,
        num_warps=sz.warps,
        num_stages=sz.scan_stages,
    )

    dB = _empty(B.shape, B, B.dtype)
    dC = _empty(C.shape, C, C.dtype)
    for out, w, state in ((dC, B, entering), (dB, C, dstates)):
        _dbc_kernel[(sz.batch * sz.nchunks * sz.ngroups, triton.cdiv(sz.chunk, sz.block_k))](
            x,
            w,
            dtp,
            cs,
            doc,
            dy,
            state,
            out,
            *sz.dims(),
            *x.stride(),
            *w.stride(),
            sdb,
            GRAD_C=out is dC,
            HAS_DOC=doc is not None,
            PREC=sz.prec,
            BLOCK_M=sz.block_k,
            BLOCK_K=sz.block_k,
            BLOCK_P=sz.block_p,
            BLOCK_N=sz.block_n,
            num_warps=sz.warps,
            num_stages=sz.dbc_stages,
        )

    ddt = _empty(dt.shape, dt, dt.dtype)
    da_part = _empty((sz.batch, sz.nchunks, sz.nheads), x)
    dbias_part = _empty(da_part.shape, x) if dt_bias is not None else None
    # 8 warps: 72-77 registers, 24 resident warps per SM on sm_90 (Triton 3.6).
    _dt_bwd_kernel[(sz.batch, sz.nchunks, triton.cdiv(sz.nheads, sz.block_h))](
        dt,
        dt_bias,
        A,
        dtp,
        dlogdecay_parts,
        ddt_direct,
        wstate,
        sdot_part.sum(-1),
        ddt,
        da_part,
        dbias_part,
        log_decay_grad,
        sz.seqlen,
        sz.nheads,
        sz.nchunks,
        sz.chunk,
        row_blocks,
        sz.block_m,
        *dt.stride(),
        *ddt.stride(),
        float(dt_limit[0]),
        float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus,
        STORE_DLOG=log_decay_grad is not None,
        BLOCK_H=sz.block_h,
        BLOCK_Q=sz.block_q,
        num_warps=8,
    )

    dA = da_part.sum((0, 1)).to(A.dtype)
    dD = None
    if D is not None:
        dD = dd_part.sum(0)
        dD = (dD if D.dim() == 2 else dD.sum(-1)).to(D.dtype)
    d_bias = dbias_part.sum((0, 1)).to(dt_bias.dtype) if dt_bias is not None else None
    d_init = dinit.to(initial_states.dtype) if initial_states is not None else None
    return dx, ddt, dA, dB, dC, dD, dz, d_bias, d_init


class _SSDChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size, dt_softplus, dt_limit):
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
        ctx.meta = (chunk_size, dt_softplus, dt_limit)
        return forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = ctx.saved_tensors
        chunk_size, dt_softplus, dt_limit = ctx.meta
        grads = backward(
            dout, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit
        )
        return *grads, None, None, None, None


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
    """Mamba-2 scan (as mamba_ssm's mamba_chunk_scan_combined); see megamamba.kernels.

    Returns y in x's dtype [, final_states (batch, nheads, headdim, dstate) in float32].
    """
    y, final = _SSDChunkScan.apply(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size, dt_softplus, tuple(dt_limit)
    )
    return (y, final) if return_final_states else y
