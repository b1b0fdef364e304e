"""Depthwise causal conv1d (width 2-4, optional SiLU, document boundaries): forward and backward.

out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width-1) + k]), where a tap
is dropped when it lies before the sequence start or in an earlier document. Every tensor is
read and written through its strides, and outputs keep x's layout: Mamba-2's input is a
transposed (batch, seqlen, dim) slice, so tiles are 64 channels wide there and 64 steps long for
time-contiguous x. The backward is one kernel that reads x and dout and writes dx once; each
program walks a range of time blocks and sums the weight gradient in registers, one partial per
program. Offsets within a sequence are 32-bit unless they could overflow (`_needs_int64`).
"""

import torch
import triton
import triton.language as tl

from . import common


@triton.jit
def _preact(
    x_ptr,
    w_ptr,
    bias_ptr,
    doc_ptr,
    d,
    t,
    d_mask,
    t_mask,
    sxd,
    sxl,
    swd,
    swk,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Convolution before the activation for a (BLOCK_D, BLOCK_L) tile of one sequence (x_ptr and
    doc_ptr point at its start), in float32."""
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + t, mask=t_mask, other=0)
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1 - k)
        ok = t_mask & (src >= 0)
        if HAS_DOC:
            ok = ok & (tl.load(doc_ptr + src, mask=ok, other=-1) == doc_t)
        xv = tl.load(x_ptr + d[:, None] * sxd + src[None, :] * sxl, mask=d_mask[:, None] & ok[None, :], other=0.0).to(
            tl.float32
        )
        wv = tl.load(w_ptr + d * swd + k * swk, mask=d_mask, other=0.0).to(tl.float32)
        acc += wv[:, None] * xv
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _conv_fwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    doc_ptr,
    out_ptr,
    dim,
    seqlen,
    sxb,
    sxd,
    sxl,
    swd,
    swk,
    sdb,
    sob,
    sod,
    sol,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    SILU: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    x_ptr += b * sxb
    if HAS_DOC:
        doc_ptr += b * sdb
    out_ptr += b * sob
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    if INT64:
        d = d.to(tl.int64)
        t = t.to(tl.int64)
    d_mask = d < dim
    t_mask = t < seqlen
    acc = _preact(
        x_ptr,
        w_ptr,
        bias_ptr,
        doc_ptr,
        d,
        t,
        d_mask,
        t_mask,
        sxd,
        sxl,
        swd,
        swk,
        WIDTH,
        HAS_BIAS,
        HAS_DOC,
        BLOCK_D,
        BLOCK_L,
    )
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + d[:, None] * sod + t[None, :] * sol,
        acc.to(out_ptr.dtype.element_ty),
        mask=d_mask[:, None] & t_mask[None, :],
    )


@triton.jit
def _conv_bwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    doc_ptr,
    dout_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    dim,
    seqlen,
    time_programs,
    blocks_per_program,
    sxb,
    sxd,
    sxl,
    swd,
    swk,
    sdb,
    sgb,
    sgd,
    sgl,
    sdxb,
    sdxd,
    sdxl,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    SILU: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """dx for blocks_per_program consecutive time blocks of one channel block, and this program's
    sums of dweight and dbias over them (row pid0 of (batch * time_programs, dim, WIDTH) / (.., dim)).

    With g = dout * act'(preact): dx[s] = sum_j weight[WIDTH-1-j] * g[s+j] over taps in the same
    document; g at the WIDTH-1 positions past the block is recomputed (its inputs come from cache).
    """
    pid = tl.program_id(0)
    b = (pid // time_programs).to(tl.int64)
    x_ptr += b * sxb
    if HAS_DOC:
        doc_ptr += b * sdb
    dout_ptr += b * sgb
    dx_ptr += b * sdxb
    first = (pid % time_programs) * blocks_per_program
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if INT64:
        d = d.to(tl.int64)
    d_mask = d < dim
    db_acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    dw0 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    dw1 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    for i in range(blocks_per_program):
        s = (first + i) * BLOCK_L + tl.arange(0, BLOCK_L)
        if INT64:
            s = s.to(tl.int64)
        s_mask = s < seqlen
        if HAS_DOC:
            doc_s = tl.load(doc_ptr + s, mask=s_mask, other=0)
        dx = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            u = s + j
            u_ok = u < seqlen
            if HAS_DOC:
                u_ok = u_ok & (tl.load(doc_ptr + u, mask=u_ok, other=-1) == doc_s)
            g = tl.load(
                dout_ptr + d[:, None] * sgd + u[None, :] * sgl, mask=d_mask[:, None] & u_ok[None, :], other=0.0
            ).to(tl.float32)
            if SILU:
                pre = _preact(
                    x_ptr,
                    w_ptr,
                    bias_ptr,
                    doc_ptr,
                    d,
                    u,
                    d_mask,
                    u_ok,
                    sxd,
                    sxl,
                    swd,
                    swk,
                    WIDTH,
                    HAS_BIAS,
                    HAS_DOC,
                    BLOCK_D,
                    BLOCK_L,
                )
                sig = tl.sigmoid(pre)
                g = g * sig * (1.0 + pre * (1.0 - sig))
            wv = tl.load(w_ptr + d * swd + (WIDTH - 1 - j) * swk, mask=d_mask, other=0.0).to(tl.float32)
            dx += wv[:, None] * g
            if j == 0:  # g at the block's own positions: the weight and bias gradients
                if HAS_BIAS:
                    db_acc += g
                for k in tl.static_range(WIDTH):
                    src = s - (WIDTH - 1 - k)
                    ok = s_mask & (src >= 0)
                    if HAS_DOC:
                        ok = ok & (tl.load(doc_ptr + src, mask=ok, other=-1) == doc_s)
                    xv = tl.load(
                        x_ptr + d[:, None] * sxd + src[None, :] * sxl, mask=d_mask[:, None] & ok[None, :], other=0.0
                    ).to(tl.float32)
                    if k == 0:
                        dw0 += g * xv
                    elif k == 1:
                        dw1 += g * xv
                    elif k == 2:
                        dw2 += g * xv
                    else:
                        dw3 += g * xv
        tl.store(
            dx_ptr + d[:, None] * sdxd + s[None, :] * sdxl,
            dx.to(dx_ptr.dtype.element_ty),
            mask=d_mask[:, None] & s_mask[None, :],
        )
    out = dw_ptr + (pid * dim + d) * WIDTH
    tl.store(out, tl.sum(dw0, axis=1), mask=d_mask)
    tl.store(out + 1, tl.sum(dw1, axis=1), mask=d_mask)
    if WIDTH > 2:
        tl.store(out + 2, tl.sum(dw2, axis=1), mask=d_mask)
    if WIDTH > 3:
        tl.store(out + 3, tl.sum(dw3, axis=1), mask=d_mask)
    if HAS_BIAS:
        tl.store(db_ptr + pid * dim + d, tl.sum(db_acc, axis=1), mask=d_mask)


def _channel_last(x) -> bool:
    """Whether x (batch, dim, seqlen) has its channels adjacent in memory (a transposed (b, L, d))."""
    return x.stride(1) == 1 and x.stride(2) != 1


def _blocks(x):
    """(BLOCK_D, BLOCK_L): 1024-element tiles, 64 wide along the dimension that is contiguous."""
    return (64, 8) if _channel_last(x) else (8, 64)


def _needs_int64(*tensors) -> bool:
    """Whether an offset within one sequence ((dim, seqlen) strides; the batch offset is always
    64-bit) may pass 2^31 - 1, so tiles must compute offsets in 64 bits (more registers)."""
    return any(
        max(0, t.shape[1] - 1) * abs(t.stride(1))
        + max(0, t.shape[2] - 1) * abs(t.stride(2))
        + 64 * (abs(t.stride(1)) + abs(t.stride(2)))
        >= 2**31
        for t in tensors
    )


def _empty_like(x):
    """A (batch, dim, seqlen) buffer in x's layout (channel-last stays channel-last)."""
    batch, dim, seqlen = x.shape
    if _channel_last(x):
        return common.empty((batch, seqlen, dim), device=x.device, dtype=x.dtype).transpose(1, 2)
    return common.empty((batch, dim, seqlen), device=x.device, dtype=x.dtype)


def _check(x, weight, bias, activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, dim, seqlen), got {tuple(x.shape)}")
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape (dim={dim}, width in 2..4), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must have shape (dim,) = ({dim},), got {tuple(bias.shape)}")


def forward(x, weight, bias=None, seq_idx=None, activation=None):
    """The conv's output, in x's layout."""
    _check(x, weight, bias, activation)
    batch, dim, seqlen = x.shape
    doc = common.document_counters(seq_idx, batch, seqlen)
    block_d, block_l = _blocks(x)
    out = _empty_like(x)
    _conv_fwd_kernel[(batch, triton.cdiv(dim, block_d), triton.cdiv(seqlen, block_l))](
        x,
        weight,
        bias,
        doc,
        out,
        dim,
        seqlen,
        *x.stride(),
        *weight.stride(),
        doc.stride(0) if doc is not None else 0,
        *out.stride(),
        WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        HAS_DOC=doc is not None,
        SILU=activation is not None,
        INT64=_needs_int64(x, out),
        BLOCK_D=block_d,
        BLOCK_L=block_l,
    )
    return out


def backward(dout, x, weight, bias=None, seq_idx=None, activation=None):
    """(dx in x's layout, dweight, dbias or None) from the output's gradient."""
    batch, dim, seqlen = x.shape
    doc = common.document_counters(seq_idx, batch, seqlen)
    width = weight.shape[1]
    block_d, block_l = _blocks(x)
    d_blocks, t_blocks = triton.cdiv(dim, block_d), triton.cdiv(seqlen, block_l)
    target = max(1, 8 * common.multiprocessors(x.device) // (batch * d_blocks))
    per = triton.cdiv(t_blocks, min(t_blocks, target))
    time_programs = triton.cdiv(t_blocks, per)
    rows = batch * time_programs
    dx = _empty_like(x)
    dw_part = common.empty((rows, dim, width), device=x.device, dtype=torch.float32)
    db_part = common.empty((rows, dim), device=x.device, dtype=torch.float32) if bias is not None else None
    # 8 warps of <= 128 registers: 16 resident warps per SM on sm_90 without spills (with 4
    # warps, 128 registers spill in bf16 with documents).
    _conv_bwd_kernel[(rows, d_blocks)](
        x,
        weight,
        bias,
        doc,
        dout,
        dx,
        dw_part,
        db_part,
        dim,
        seqlen,
        time_programs,
        per,
        *x.stride(),
        *weight.stride(),
        doc.stride(0) if doc is not None else 0,
        *dout.stride(),
        *dx.stride(),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        HAS_DOC=doc is not None,
        SILU=activation is not None,
        INT64=_needs_int64(x, dout, dx),
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        num_warps=8,
        maxnreg=128,
    )
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, activation):
        ctx.save_for_backward(x, weight, bias, seq_idx)
        ctx.options = (activation,)
        return forward(x, weight, bias, seq_idx, activation)

    @staticmethod
    def backward(ctx, dout):
        return *backward(dout, *ctx.saved_tensors, *ctx.options), None, None


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """Depthwise causal conv over (batch, dim, seqlen) with weight (dim, width), width 2-4."""
    return _CausalConv1d.apply(x, weight, bias, seq_idx, activation)
