"""Gated RMSNorm over groups of the last dim (as mamba_ssm's rmsnorm_fn): forward and backward.

Each group of group_size channels: v * rsqrt(mean(v^2) + eps) * weight (+ bias), where
v = x, or x * silu(z) when the gate comes before the norm; with the gate after the norm the
result is multiplied by silu(z). Each program owns BLOCK_M rows of one group; the backward
recomputes the statistics instead of storing them.
"""
import torch
import triton
import triton.language as tl

from . import common


def _launch(group_size):
    """(BLOCK_M, BLOCK_G, num_warps): at most 4096 elements per program (16 rows of small groups)."""
    block_g = common.block(group_size, lo=1)
    return max(1, min(16, 4096 // block_g)), block_g, 8 if block_g >= 2048 else 4


@triton.jit
def _norm_fwd_kernel(x_ptr, z_ptr, w_ptr, b_ptr, out_ptr, rows, n, group_size, eps,
                     HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_G)
    c = tl.program_id(1) * group_size + j
    c_mask = j < group_size
    mask = (r < rows)[:, None] & c_mask[None, :]
    offs = r[:, None] * n + c[None, :]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if not NORM_BEFORE_GATE:
            v = v * gate
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / group_size + eps)
    y = v * rstd[:, None] * tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(x_ptr, z_ptr, w_ptr, b_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, db_ptr,
                     rows, n, group_size, eps,
                     HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """dx, dz, and this program's partial sums of dweight / dbias (row pid0 of (blocks, n))."""
    pid_m = tl.program_id(0)
    r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_G)
    c = tl.program_id(1) * group_size + j
    c_mask = j < group_size
    mask = (r < rows)[:, None] & c_mask[None, :]
    offs = r[:, None] * n + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    v = x
    if HAS_Z:
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        gate = z * sig
        dgate = sig * (1.0 + z * (1.0 - sig))
        if not NORM_BEFORE_GATE:
            v = x * gate
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / group_size + eps)
    vhat = v * rstd[:, None]
    dyn = dy
    if HAS_Z:
        if NORM_BEFORE_GATE:
            yn = vhat * w[None, :]
            if HAS_BIAS:
                yn += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(dz_ptr + offs, (dy * yn * dgate).to(dz_ptr.dtype.element_ty), mask=mask)
            dyn = dy * gate
    tl.store(dw_ptr + pid_m * n + c, tl.sum(dyn * vhat, axis=0), mask=c_mask)
    if HAS_BIAS:
        tl.store(db_ptr + pid_m * n + c, tl.sum(dyn, axis=0), mask=c_mask)
    dvhat = dyn * w[None, :]
    dv = rstd[:, None] * (dvhat - vhat * (tl.sum(dvhat * vhat, axis=1) / group_size)[:, None])
    dx = dv
    if HAS_Z:
        if not NORM_BEFORE_GATE:
            dx = dv * gate
            tl.store(dz_ptr + offs, (dv * x * dgate).to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class _RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z, eps, group_size, norm_before_gate):
        shape = x.shape
        n = shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        z2 = z.reshape(-1, n).contiguous() if z is not None else None
        rows = x2.shape[0]
        out = common.empty(x2.shape, device=x.device, dtype=x.dtype)
        block_m, block_g, warps = _launch(group_size)
        grid = (triton.cdiv(rows, block_m), n // group_size)
        _norm_fwd_kernel[grid](x2, z2, weight, bias, out, rows, n, group_size, eps,
                               HAS_Z=z is not None, HAS_BIAS=bias is not None,
                               NORM_BEFORE_GATE=norm_before_gate, BLOCK_M=block_m, BLOCK_G=block_g,
                               num_warps=warps)
        ctx.save_for_backward(x2, z2, weight, bias)
        ctx.meta = (shape, eps, group_size, norm_before_gate)
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, dout):
        x2, z2, weight, bias = ctx.saved_tensors
        shape, eps, group_size, norm_before_gate = ctx.meta
        rows, n = x2.shape
        dy = dout.reshape(rows, n).contiguous()
        block_m, block_g, warps = _launch(group_size)
        grid = (triton.cdiv(rows, block_m), n // group_size)
        dx = common.empty(x2.shape, device=x2.device, dtype=x2.dtype)
        dz = common.empty(x2.shape, device=x2.device, dtype=z2.dtype) if z2 is not None else None
        dw_part = common.empty((grid[0], n), device=x2.device, dtype=torch.float32)
        db_part = common.empty((grid[0], n), device=x2.device, dtype=torch.float32) if bias is not None else None
        _norm_bwd_kernel[grid](x2, z2, weight, bias, dy, dx, dz, dw_part, db_part, rows, n,
                               group_size, eps, HAS_Z=z2 is not None, HAS_BIAS=bias is not None,
                               NORM_BEFORE_GATE=norm_before_gate, BLOCK_M=block_m, BLOCK_G=block_g,
                               num_warps=warps)
        dweight = dw_part.sum(0).to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        dz = dz.reshape(shape) if dz is not None else None
        return dx.reshape(shape), dweight, dbias, dz, None, None, None


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMSNorm of x over groups of group_size channels of the last dim, gated by silu(z)."""
    n = x.shape[-1]
    group_size = n if group_size is None else group_size
    if group_size <= 0 or n % group_size != 0:
        raise ValueError(f"group_size must divide the last dim {n}, got {group_size}")
    if tuple(weight.shape) != (n,):
        raise ValueError(f"weight must have shape ({n},), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    return _RMSNormGated.apply(x, weight, bias, z, eps, group_size, norm_before_gate)
