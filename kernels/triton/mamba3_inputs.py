"""Mamba-3's preprocessing on Triton: in_proj's raw columns -> the scan's inputs in one kernel, and its
backward in another (the reference is kernels/reference/mamba3_inputs.py).

One program per (sequence, head) walks the sequence in blocks of tokens (16, fewer for a wide state). Per
token it computes Δ, A and λ, adds Δ·π·tanh(angles) to the running angle (a segmented scan: a document start
restarts it, the carry between blocks is the angle so far, modulo 2π) and normalises, biases and rotates each
MIMO channel of B and C. Every state dimension holds its own copy of its pair's angle, and reads its partner's
value by a second load, so the rotation needs no shuffle between lanes. The backward walks the blocks in
reverse: the angle's gradient is the reverse segmented sum of what the rotations and the angle output receive.
What many programs share (the B/C norm weights, the biases, dt_bias, the heads' shared angle columns, B/C
columns read by several heads) is written per program and summed in PyTorch.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.mamba3_inputs import A_ACTIVATIONS, ROTATIONS, ScanInputs, check_inputs
from . import common
from .common import block, combine_steps, document_counters, softplus

# Tokens per block: 16, fewer where a wide state would make a (tokens, dstate) tile hold more than TILE elements,
# 4 per thread in the forward (4 warps) and 2 in the backward (8 warps), which holds a dozen such tiles. At dstate
# 128 with 16 tokens and 4 warps the backward spilled at 255 registers, and neither kernel kept 16 warps per SM.
TILE, BACKWARD_WARPS = 512, 8


def _tokens_per_block(dstate: int) -> int:
    return max(1, min(16, TILE // block(dstate)))


@triton.jit
def _pairs(DSTATE: tl.constexpr, NANGLES: tl.constexpr, BLOCK_N: tl.constexpr, HALVES: tl.constexpr):
    """Per state dimension n: its pair, its partner dimension, the rotation's sign for n (-1 for the pair's
    first dimension, +1 for its second) and whether the pair is rotated."""
    n = tl.arange(0, BLOCK_N)
    if HALVES:
        first = n < DSTATE // 2
        pair = tl.where(first, n, n - DSTATE // 2)
        partner = tl.where(first, n + DSTATE // 2, n - DSTATE // 2)
    else:
        first = n % 2 == 0
        pair = n // 2
        partner = tl.where(first, n + 1, n - 1)
    rotated = (pair < NANGLES) & (n < DSTATE)
    return n, pair, partner, tl.where(first, -1.0, 1.0), first & rotated, rotated


@triton.jit
def _tanh(v):
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(v < 0, -t, t)


@triton.jit
def _keep(doc_ptr, b, t, t_mask, seqlen):
    """1 where token t continues the document of token t - 1 (and at t = 0), else 0."""
    doc = tl.load(doc_ptr + b * seqlen + t, mask=t_mask, other=0)
    prev = tl.load(doc_ptr + b * seqlen + t - 1, mask=t_mask & (t > 0), other=0)
    return tl.where((t > 0) & (doc != prev), 0.0, 1.0)


@triton.jit
def _normed(x_ptr, w_ptr, bias_ptr, r, n, partner, n_mask, rotated, tn_mask, rows, eps, DSTATE: tl.constexpr):
    """The raw rows x (tokens, dstate) of one channel: rstd, x and its partner values, and u = x·rstd·w + bias
    with its partner values."""
    x = tl.load(x_ptr + rows + n[None, :], mask=tn_mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows + partner[None, :], mask=tn_mask & rotated[None, :], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DSTATE + eps)
    w = tl.load(w_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + r * DSTATE + n, mask=n_mask, other=0.0).to(tl.float32)
    bias_p = tl.load(bias_ptr + r * DSTATE + partner, mask=rotated, other=0.0).to(tl.float32)
    u = x * rstd[:, None] * w[None, :] + bias[None, :]
    up = xp * rstd[:, None] * wp[None, :] + bias_p[None, :]
    return x, w, rstd, u, up


@triton.jit
def _inputs_fwd_kernel(
    B_ptr, C_ptr, ddt_ptr, dA_ptr, trap_ptr, ang_ptr, dt_bias_ptr, wB_ptr, wC_ptr, bB_ptr, bC_ptr, doc_ptr, init_ptr,
    oB_ptr, oC_ptr, odt_ptr, oA_ptr, olam_ptr, oang_ptr,
    seqlen, nheads, heads_per_group, A_floor, eps,
    sbb, sbt, sbr, sbg, scb, sct, scr, scg, sdb, sdt, sab, sat, stb, stt, sgb, sgt,
    RANK: tl.constexpr, DSTATE: tl.constexpr, NANGLES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, HALVES: tl.constexpr, HEAVY_TAIL: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_INIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // heads_per_group
    n, pair, partner, sign, stores_angle, rotated = _pairs(DSTATE, NANGLES, BLOCK_N, HALVES)
    n_mask = n < DSTATE
    carry = tl.zeros([BLOCK_N], tl.float32)
    if HAS_INIT:
        carry = tl.load(init_ptr + (b * nheads + h) * NANGLES + pair, mask=rotated, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t0 in range(0, seqlen, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < seqlen
        dt = softplus(tl.load(ddt_ptr + b * sdb + t * sdt + h, mask=t_mask, other=0.0).to(tl.float32) + dt_bias)
        v = tl.load(dA_ptr + b * sab + t * sat + h, mask=t_mask, other=0.0).to(tl.float32)
        if HEAVY_TAIL:
            f = tl.maximum(v, 0.0) + 1.0 / (1.0 - tl.minimum(v, 0.0))
        else:
            f = softplus(v)
        lam = tl.sigmoid(tl.load(trap_ptr + b * stb + t * stt + h, mask=t_mask, other=0.0).to(tl.float32))
        out = (b * seqlen + t) * nheads + h
        tl.store(odt_ptr + out, dt, mask=t_mask)
        tl.store(oA_ptr + out, tl.minimum(-f, -A_floor), mask=t_mask)
        tl.store(olam_ptr + out, lam, mask=t_mask)

        t_rot = t_mask[:, None] & rotated[None, :]
        a = tl.load(ang_ptr + b * sgb + t[:, None] * sgt + pair[None, :], mask=t_rot, other=0.0).to(tl.float32)
        increment = dt[:, None] * math.pi * _tanh(a)
        if HAS_DOC:
            keep = tl.broadcast_to(_keep(doc_ptr, b, t, t_mask, seqlen)[:, None], (BLOCK_T, BLOCK_N))
            reached, total = tl.associative_scan((keep, increment), 0, combine_steps)
            total += reached * carry[None, :]
        else:
            total = tl.cumsum(increment, axis=0) + carry[None, :]
        angle = total - 2 * math.pi * tl.floor(total / (2 * math.pi))
        last = tl.minimum(t0 + BLOCK_T, seqlen) - 1
        carry = tl.sum(tl.where((t == last)[:, None], angle, 0.0), axis=0)
        tl.store(oang_ptr + out[:, None] * NANGLES + pair[None, :], angle, mask=t_mask[:, None] & stores_angle[None, :])

        cos, sin = tl.cos(angle), tl.sin(angle)
        tn_mask = t_mask[:, None] & n_mask[None, :]
        for r in range(RANK):
            rows = out[:, None] * RANK * DSTATE + r * DSTATE
            for_B = b * sbb + t[:, None] * sbt + r * sbr + g * sbg
            _, _, _, u, up = _normed(B_ptr, wB_ptr, bB_ptr + h * RANK * DSTATE, r, n, partner, n_mask, rotated,
                                     tn_mask, for_B, eps, DSTATE)  # fmt: skip
            tl.store(oB_ptr + rows + n[None, :], _rotate(u, up, cos, sin, sign, rotated), mask=tn_mask)
            for_C = b * scb + t[:, None] * sct + r * scr + g * scg
            _, _, _, u, up = _normed(C_ptr, wC_ptr, bC_ptr + h * RANK * DSTATE, r, n, partner, n_mask, rotated,
                                     tn_mask, for_C, eps, DSTATE)  # fmt: skip
            tl.store(oC_ptr + rows + n[None, :], _rotate(u, up, cos, sin, sign, rotated), mask=tn_mask)


@triton.jit
def _rotate(u, up, cos, sin, sign, rotated):
    """out[n] = u cos + s up sin on the rotated dimensions (s = -1 for a pair's first, +1 for its second)."""
    return tl.where(rotated[None, :], u * cos + sign[None, :] * up * sin, u)


@triton.jit
def _channel_bwd(
    x_ptr, w_ptr, bias_ptr, gx_ptr, dx_ptr, raw, rows, r, n, partner, sign, n_mask, rotated, tn_mask, t_rot, cos,
    sin, eps, DSTATE: tl.constexpr,
):  # fmt: skip
    """One channel of B or C: writes the raw rows' gradient; returns its share of the angle's gradient (each
    dimension of a pair holding the pair's), of the norm weight's and of the bias's (over the block)."""
    x, w, rstd, u, up = _normed(x_ptr, w_ptr, bias_ptr, r, n, partner, n_mask, rotated, tn_mask, raw, eps, DSTATE)
    gx = tl.load(gx_ptr + rows + n[None, :], mask=tn_mask, other=0.0)
    gp = tl.load(gx_ptr + rows + partner[None, :], mask=t_rot, other=0.0)
    # out[n] = u cos + s up sin and out[partner] = up cos - s u sin
    d_angle = tl.where(rotated[None, :], -sin * (gx * u + gp * up) + sign[None, :] * cos * (gx * up - gp * u), 0.0)
    du = tl.where(rotated[None, :], gx * cos - sign[None, :] * gp * sin, gx)
    wdu = tl.where(tn_mask, w[None, :] * du, 0.0)
    dx = rstd[:, None] * wdu - x * (rstd * rstd * rstd / DSTATE * tl.sum(wdu * x, axis=1))[:, None]
    tl.store(dx_ptr + rows + n[None, :], dx, mask=tn_mask)
    dw = tl.sum(tl.where(tn_mask, du * x * rstd[:, None], 0.0), axis=0)
    return d_angle, dw, tl.sum(tl.where(tn_mask, du, 0.0), axis=0)


@triton.jit
def _inputs_bwd_kernel(
    B_ptr, C_ptr, ddt_ptr, dA_ptr, trap_ptr, ang_ptr, dt_bias_ptr, wB_ptr, wC_ptr, bB_ptr, bC_ptr, doc_ptr,
    angle_ptr, gB_ptr, gC_ptr, gdt_ptr, gA_ptr, glam_ptr, gang_ptr,
    dB_ptr, dC_ptr, dddt_ptr, ddA_ptr, dtrap_ptr, dang_ptr, ddt_bias_ptr, dwB_ptr, dwC_ptr, dbB_ptr, dbC_ptr,
    dinit_ptr,
    seqlen, nheads, heads_per_group, A_floor, eps,
    sbb, sbt, sbr, sbg, scb, sct, scr, scg, sdb, sdt, sab, sat, stb, stt, sgb, sgt,
    RANK: tl.constexpr, RANK_P2: tl.constexpr, DSTATE: tl.constexpr, NANGLES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, HALVES: tl.constexpr, HEAVY_TAIL: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_GRAD_ANGLE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // heads_per_group
    n, pair, partner, sign, stores_angle, rotated = _pairs(DSTATE, NANGLES, BLOCK_N, HALVES)
    n_mask = n < DSTATE
    ranks = tl.arange(0, RANK_P2)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    carry = tl.zeros([BLOCK_N], tl.float32)  # the angle's gradient at the first token of the block after
    d_dt_bias = tl.zeros([BLOCK_T], tl.float32)
    dwB = tl.zeros([BLOCK_N], tl.float32)
    dwC = tl.zeros([BLOCK_N], tl.float32)
    dbB = tl.zeros([RANK_P2, BLOCK_N], tl.float32)
    dbC = tl.zeros([RANK_P2, BLOCK_N], tl.float32)
    nblocks = tl.cdiv(seqlen, BLOCK_T)
    for i in range(nblocks):
        t0 = (nblocks - 1 - i) * BLOCK_T
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < seqlen
        out = (b * seqlen + t) * nheads + h
        tn_mask = t_mask[:, None] & n_mask[None, :]
        t_rot = t_mask[:, None] & rotated[None, :]
        angle = tl.load(angle_ptr + out[:, None] * NANGLES + pair[None, :], mask=t_rot, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        d_angle = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        if HAS_GRAD_ANGLE:
            d_angle += tl.load(gang_ptr + out[:, None] * NANGLES + pair[None, :], mask=t_rot, other=0.0)
        for r in range(RANK):
            rows = out[:, None] * RANK * DSTATE + r * DSTATE
            in_rank = (ranks == r)[:, None]
            for_B = b * sbb + t[:, None] * sbt + r * sbr + g * sbg
            d, dw, db = _channel_bwd(B_ptr, wB_ptr, bB_ptr + h * RANK * DSTATE, gB_ptr, dB_ptr, for_B, rows, r, n,
                                     partner, sign, n_mask, rotated, tn_mask, t_rot, cos, sin, eps, DSTATE)  # fmt: skip
            d_angle += d
            dwB += dw
            dbB += tl.where(in_rank, db[None, :], 0.0)
            for_C = b * scb + t[:, None] * sct + r * scr + g * scg
            d, dw, db = _channel_bwd(C_ptr, wC_ptr, bC_ptr + h * RANK * DSTATE, gC_ptr, dC_ptr, for_C, rows, r, n,
                                     partner, sign, n_mask, rotated, tn_mask, t_rot, cos, sin, eps, DSTATE)  # fmt: skip
            d_angle += d
            dwC += dw
            dbC += tl.where(in_rank, db[None, :], 0.0)

        # the reverse segmented sum: an angle's increment moves every later angle of its document
        if HAS_DOC:
            keep_next = tl.where(t + 1 < seqlen, _keep(doc_ptr, b, t + 1, t + 1 < seqlen, seqlen), 0.0)
            keep_next = tl.broadcast_to(keep_next[:, None], (BLOCK_T, BLOCK_N))
            reached, d_increment = tl.associative_scan((keep_next, d_angle), 0, combine_steps, reverse=True)
            d_increment += reached * carry[None, :]
        else:  # the rows past the sequence's end hold no gradient
            d_increment = tl.cumsum(d_angle, axis=0, reverse=True) + carry[None, :]
        carry = tl.sum(tl.where((t == t0)[:, None], d_increment, 0.0), axis=0)

        v_dt = tl.load(ddt_ptr + b * sdb + t * sdt + h, mask=t_mask, other=0.0).to(tl.float32) + dt_bias
        dt = softplus(v_dt)
        a = tl.load(ang_ptr + b * sgb + t[:, None] * sgt + pair[None, :], mask=t_rot, other=0.0).to(tl.float32)
        tanh = _tanh(a)
        d_pair = tl.where(t_mask[:, None] & stores_angle[None, :], d_increment, 0.0)
        d_dt = tl.load(gdt_ptr + out, mask=t_mask, other=0.0) + tl.sum(d_pair * math.pi * tanh, axis=1)
        tl.store(
            dang_ptr + out[:, None] * NANGLES + pair[None, :],
            d_pair * dt[:, None] * math.pi * (1.0 - tanh * tanh),
            mask=t_mask[:, None] & stores_angle[None, :],
        )
        d_v_dt = tl.where(t_mask, d_dt * tl.sigmoid(v_dt), 0.0)
        tl.store(dddt_ptr + out, d_v_dt, mask=t_mask)
        d_dt_bias += d_v_dt

        v = tl.load(dA_ptr + b * sab + t * sat + h, mask=t_mask, other=0.0).to(tl.float32)
        if HEAVY_TAIL:
            f = tl.maximum(v, 0.0) + 1.0 / (1.0 - tl.minimum(v, 0.0))
            df = tl.where(v >= 0, 1.0, 1.0 / ((1.0 - v) * (1.0 - v)))
        else:
            f = softplus(v)
            df = tl.sigmoid(v)
        gA = tl.load(gA_ptr + out, mask=t_mask, other=0.0)
        tl.store(ddA_ptr + out, tl.where(f >= A_floor, -gA * df, 0.0), mask=t_mask)
        lam = tl.sigmoid(tl.load(trap_ptr + b * stb + t * stt + h, mask=t_mask, other=0.0).to(tl.float32))
        tl.store(dtrap_ptr + out, tl.load(glam_ptr + out, mask=t_mask, other=0.0) * lam * (1.0 - lam), mask=t_mask)

    program = b * nheads + h
    tl.store(dinit_ptr + program * NANGLES + pair, carry, mask=stores_angle)
    tl.store(ddt_bias_ptr + program, tl.sum(d_dt_bias, axis=0))
    tl.store(dwB_ptr + program * DSTATE + n, dwB, mask=n_mask)
    tl.store(dwC_ptr + program * DSTATE + n, dwC, mask=n_mask)
    bias_rows = (program * RANK + ranks[:, None]) * DSTATE + n[None, :]
    bias_mask = (ranks[:, None] < RANK) & n_mask[None, :]
    tl.store(dbB_ptr + bias_rows, dbB, mask=bias_mask)
    tl.store(dbC_ptr + bias_rows, dbC, mask=bias_mask)


def _check_options(a_activation: str, rotation: str) -> None:
    if a_activation not in A_ACTIVATIONS:
        raise ValueError(f"a_activation={a_activation!r}: choose one of {A_ACTIVATIONS}")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: choose one of {ROTATIONS}")


def _last_dim_contiguous(*tensors):
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _strides(B, C, dd_dt, dd_A, trap, angles) -> tuple:
    return (*B.stride()[:4], *C.stride()[:4], *dd_dt.stride()[:2], *dd_A.stride()[:2], *trap.stride()[:2])


def forward(
    B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, A_floor: float,
    a_activation: str, rotation: str, norm_eps: float, seq_idx=None, initial_angle: Optional[torch.Tensor] = None,
) -> ScanInputs:  # fmt: skip
    """The reference's `mamba3_scan_inputs`, in float32 on Triton."""
    check_inputs(B, C, dd_dt, dd_A, trap, angles, B_bias, C_bias, initial_angle)
    _check_options(a_activation, rotation)
    B, C, dd_dt, dd_A, trap, angles = _last_dim_contiguous(B, C, dd_dt, dd_A, trap, angles)
    batch, seqlen, rank, ngroups, dstate = B.shape
    nheads, nangles = dd_dt.shape[-1], angles.shape[-1]
    device, f32 = B.device, torch.float32
    Bh = common.empty((batch, seqlen, nheads, rank, dstate), device=device, dtype=f32)
    Ch = common.empty((batch, seqlen, nheads, rank, dstate), device=device, dtype=f32)
    dt, A, lam = (common.empty((batch, seqlen, nheads), device=device, dtype=f32) for _ in range(3))
    angle = common.empty((batch, seqlen, nheads, nangles), device=device, dtype=f32)
    doc = document_counters(seq_idx, batch, seqlen)
    init = None if initial_angle is None else initial_angle.to(f32).contiguous()
    _inputs_fwd_kernel[(batch, nheads)](
        B, C, dd_dt, dd_A, trap, angles, dt_bias.contiguous(), B_norm_weight.contiguous(),
        C_norm_weight.contiguous(), B_bias.contiguous(), C_bias.contiguous(), doc, init,
        Bh, Ch, dt, A, lam, angle,
        seqlen, nheads, nheads // ngroups, A_floor, norm_eps,
        *_strides(B, C, dd_dt, dd_A, trap, angles), *angles.stride()[:2],
        RANK=rank, DSTATE=dstate, NANGLES=nangles, BLOCK_N=block(dstate),
        BLOCK_T=_tokens_per_block(dstate),
        HALVES=rotation == "halves", HEAVY_TAIL=a_activation == "heavy_tail", HAS_DOC=doc is not None,
        HAS_INIT=init is not None,
    )  # fmt: skip
    return ScanInputs(Bh, Ch, dt, A, lam, angle)


def backward(
    grads: tuple, angle, B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias,
    A_floor: float, a_activation: str, rotation: str, norm_eps: float, seq_idx=None,
) -> tuple:  # fmt: skip
    """Gradients of (B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias,
    initial_angle) given the gradients of the outputs (B̂, Ĉ, Δ, A, λ, angle; None where one has none) and the
    forward's `angle`."""
    _check_options(a_activation, rotation)
    inputs = (B, C, dd_dt, dd_A, trap, angles)
    B, C, dd_dt, dd_A, trap, angles = _last_dim_contiguous(*inputs)
    batch, seqlen, rank, ngroups, dstate = B.shape
    nheads, nangles = dd_dt.shape[-1], angles.shape[-1]
    device, f32 = B.device, torch.float32
    per_head = (batch, seqlen, nheads)
    shapes = (*[(*per_head, rank, dstate)] * 2, *[per_head] * 3, (*per_head, nangles))
    g = [
        torch.zeros(shape, device=device, dtype=f32) if t is None else t.to(f32).contiguous()
        for t, shape in zip(grads, shapes)
    ]
    dB, dC = (common.empty((batch, seqlen, nheads, rank, dstate), device=device, dtype=f32) for _ in range(2))
    d_ddt, d_dA, d_trap = (common.empty((batch, seqlen, nheads), device=device, dtype=f32) for _ in range(3))
    d_angles = common.empty((batch, seqlen, nheads, nangles), device=device, dtype=f32)
    d_dt_bias = common.empty((batch, nheads), device=device, dtype=f32)
    dwB, dwC = (common.empty((batch, nheads, dstate), device=device, dtype=f32) for _ in range(2))
    dbB, dbC = (common.empty((batch, nheads, rank, dstate), device=device, dtype=f32) for _ in range(2))
    d_init = common.empty((batch, nheads, nangles), device=device, dtype=f32)
    doc = document_counters(seq_idx, batch, seqlen)
    _inputs_bwd_kernel[(batch, nheads)](
        B, C, dd_dt, dd_A, trap, angles, dt_bias.contiguous(), B_norm_weight.contiguous(),
        C_norm_weight.contiguous(), B_bias.contiguous(), C_bias.contiguous(), doc,
        angle.contiguous(), *g,
        dB, dC, d_ddt, d_dA, d_trap, d_angles, d_dt_bias, dwB, dwC, dbB, dbC, d_init,
        seqlen, nheads, nheads // ngroups, A_floor, norm_eps,
        *_strides(B, C, dd_dt, dd_A, trap, angles), *angles.stride()[:2],
        RANK=rank, RANK_P2=triton.next_power_of_2(rank), DSTATE=dstate, NANGLES=nangles, BLOCK_N=block(dstate),
        BLOCK_T=_tokens_per_block(dstate), HALVES=rotation == "halves", HEAVY_TAIL=a_activation == "heavy_tail",
        HAS_DOC=doc is not None, HAS_GRAD_ANGLE=grads[5] is not None, num_warps=BACKWARD_WARPS,
    )  # fmt: skip

    def per_group(d):  # (batch, seqlen, nheads, rank, dstate) -> B's layout, summed over each group's heads
        return d.unflatten(2, (ngroups, nheads // ngroups)).sum(3).transpose(2, 3).contiguous()

    out = (
        per_group(dB), per_group(dC), d_ddt, d_dA, d_trap, d_angles.sum(2), d_dt_bias.sum(0), dwB.sum((0, 1)),
        dwC.sum((0, 1)), dbB.sum(0), dbC.sum(0),
    )  # fmt: skip
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias)
    return (*(d.to(t.dtype) for d, t in zip(out, (*inputs, *params))), d_init)
