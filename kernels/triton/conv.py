"""Depthwise causal conv1d (width 2-4, optional SiLU, document boundaries): forward and backward.

out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (width-1) + k]), where a tap
is dropped when it lies before the sequence start or in an earlier document. Each program
owns a (channel block, time block) tile; time offsets are 64-bit.
"""
import torch
import triton
import triton.language as tl

from . import common

_BLOCK_D = 16
_BLOCK_L = 64


@triton.jit
def _preact(x_ptr, w_ptr, bias_ptr, doc_ptr, b, d, t, d_mask, t_mask,
            sxb, sxd, sxl, swd, swk, sdb,
            WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DOC: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Convolution before the activation for a (BLOCK_D, BLOCK_L) tile, in float32."""
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * sdb + t, mask=t_mask, other=0)
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1 - k)
        ok = t_mask & (src >= 0)
        if HAS_DOC:
            ok = ok & (tl.load(doc_ptr + b * sdb + src, mask=ok, other=-1) == doc_t)
        xv = tl.load(x_ptr + b * sxb + d[:, None] * sxd + src[None, :] * sxl,
                     mask=d_mask[:, None] & ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + d * swd + k * swk, mask=d_mask, other=0.0).to(tl.float32)
        acc += wv[:, None] * xv
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, doc_ptr, out_ptr, dim, seqlen,
                     sxb, sxd, sxl, swd, swk, sdb, sob, sod, sol,
                     WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DOC: tl.constexpr,
                     SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(2).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    d_mask = d < dim
    t_mask = t < seqlen
    acc = _preact(x_ptr, w_ptr, bias_ptr, doc_ptr, b, d, t, d_mask, t_mask,
                  sxb, sxd, sxl, swd, swk, sdb, WIDTH, HAS_BIAS, HAS_DOC, BLOCK_D, BLOCK_L)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * sob + d[:, None] * sod + t[None, :] * sol,
             acc.to(out_ptr.dtype.element_ty), mask=d_mask[:, None] & t_mask[None, :])


@triton.jit
def _conv_bwd_grad_kernel(x_ptr, w_ptr, bias_ptr, doc_ptr, dout_ptr, g_ptr, dw_ptr, db_ptr,
                          dim, seqlen, sxb, sxd, sxl, swd, swk, sdb, sgb, sgd, sgl,
                          WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DOC: tl.constexpr,
                          SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """g = dout * act'(preact) (float32), and this tile's partial sums of dweight and dbias."""
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    pid_l = tl.program_id(2)
    t = pid_l.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    d_mask = d < dim
    t_mask = t < seqlen
    tile_mask = d_mask[:, None] & t_mask[None, :]
    g = tl.load(dout_ptr + b * sgb + d[:, None] * sgd + t[None, :] * sgl,
                mask=tile_mask, other=0.0).to(tl.float32)
    if SILU:
        pre = _preact(x_ptr, w_ptr, bias_ptr, doc_ptr, b, d, t, d_mask, t_mask,
                      sxb, sxd, sxl, swd, swk, sdb, WIDTH, HAS_BIAS, HAS_DOC, BLOCK_D, BLOCK_L)
        sig = tl.sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    tl.store(g_ptr + b * sgb + d[:, None] * sgd + t[None, :] * sgl, g, mask=tile_mask)
    # Partial sums go to row (b * n_time_blocks + pid_l) of (rows, dim, WIDTH) / (rows, dim).
    row = b * tl.num_programs(2) + pid_l
    if HAS_DOC:
        doc_t = tl.load(doc_ptr + b * sdb + t, mask=t_mask, other=0)
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1 - k)
        ok = t_mask & (src >= 0)
        if HAS_DOC:
            ok = ok & (tl.load(doc_ptr + b * sdb + src, mask=ok, other=-1) == doc_t)
        xv = tl.load(x_ptr + b * sxb + d[:, None] * sxd + src[None, :] * sxl,
                     mask=d_mask[:, None] & ok[None, :], other=0.0).to(tl.float32)
        tl.store(dw_ptr + (row * dim + d) * WIDTH + k, tl.sum(g * xv, axis=1), mask=d_mask)
    if HAS_BIAS:
        tl.store(db_ptr + row * dim + d, tl.sum(g, axis=1), mask=d_mask)


@triton.jit
def _conv_bwd_dx_kernel(g_ptr, w_ptr, doc_ptr, dx_ptr, dim, seqlen,
                        sgb, sgd, sgl, swd, swk, sdb, sxb, sxd, sxl,
                        WIDTH: tl.constexpr, HAS_DOC: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """dx[s] = sum_k weight[k] * g[s + (width-1-k)] over taps in the same document."""
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.program_id(2).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    d_mask = d < dim
    s_mask = s < seqlen
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_DOC:
        doc_s = tl.load(doc_ptr + b * sdb + s, mask=s_mask, other=0)
    for k in tl.static_range(WIDTH):
        dst = s + (WIDTH - 1 - k)
        ok = s_mask & (dst < seqlen)
        if HAS_DOC:
            ok = ok & (tl.load(doc_ptr + b * sdb + dst, mask=ok, other=-1) == doc_s)
        gv = tl.load(g_ptr + b * sgb + d[:, None] * sgd + dst[None, :] * sgl,
                     mask=d_mask[:, None] & ok[None, :], other=0.0)
        wv = tl.load(w_ptr + d * swd + k * swk, mask=d_mask, other=0.0).to(tl.float32)
        acc += wv[:, None] * gv
    tl.store(dx_ptr + b * sxb + d[:, None] * sxd + s[None, :] * sxl,
             acc.to(dx_ptr.dtype.element_ty), mask=d_mask[:, None] & s_mask[None, :])


def _grid(batch, dim, seqlen):
    return (batch, triton.cdiv(dim, _BLOCK_D), triton.cdiv(seqlen, _BLOCK_L))


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, doc, silu):
        batch, dim, seqlen = x.shape
        out = common.empty((batch, dim, seqlen), device=x.device, dtype=x.dtype)
        _conv_fwd_kernel[_grid(batch, dim, seqlen)](
            x, weight, bias, doc, out, dim, seqlen, *x.stride(), *weight.stride(),
            doc.stride(0) if doc is not None else 0, *out.stride(),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, HAS_DOC=doc is not None,
            SILU=silu, BLOCK_D=_BLOCK_D, BLOCK_L=_BLOCK_L)
        ctx.save_for_backward(x, weight, bias, doc)
        ctx.silu = silu
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, doc = ctx.saved_tensors
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        grid = _grid(batch, dim, seqlen)
        rows = batch * grid[2]
        g = common.empty((batch, dim, seqlen), device=x.device, dtype=torch.float32)
        dw_part = common.empty((rows, dim, width), device=x.device, dtype=torch.float32)
        db_part = common.empty((rows, dim), device=x.device, dtype=torch.float32) if bias is not None else None
        sdb = doc.stride(0) if doc is not None else 0
        dout = dout.contiguous()  # shares g's (contiguous) strides in the kernel
        _conv_bwd_grad_kernel[grid](
            x, weight, bias, doc, dout, g, dw_part, db_part, dim, seqlen, *x.stride(),
            *weight.stride(), sdb, *g.stride(),
            WIDTH=width, HAS_BIAS=bias is not None, HAS_DOC=doc is not None, SILU=ctx.silu,
            BLOCK_D=_BLOCK_D, BLOCK_L=_BLOCK_L)
        dx = common.empty((batch, dim, seqlen), device=x.device, dtype=x.dtype)
        _conv_bwd_dx_kernel[grid](
            g, weight, doc, dx, dim, seqlen, *g.stride(), *weight.stride(), sdb, *dx.stride(),
            WIDTH=width, HAS_DOC=doc is not None, BLOCK_D=_BLOCK_D, BLOCK_L=_BLOCK_L)
        dweight = dw_part.sum(0).to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, None


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """Depthwise causal conv over (batch, dim, seqlen) with weight (dim, width), width 2-4."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, dim, seqlen), got {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape (dim={dim}, width in 2..4), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must have shape (dim,) = ({dim},), got {tuple(bias.shape)}")
    doc = common.document_counters(seq_idx, batch, seqlen)
    return _CausalConv1d.apply(x, weight, bias, doc, activation is not None)
