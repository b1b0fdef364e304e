"""Gated RMSNorm over groups of the last dim (as mamba_ssm's rmsnorm_fn): forward and backward.

Each group of group_size channels: v * rsqrt(mean(v^2) + eps) * weight (+ bias), where
v = x, or x * silu(z) when the gate comes before the norm; with the gate after the norm the
result is multiplied by silu(z). x, z and the output gradient are read through their row
strides (a column slice of a wider tensor is not copied). A forward program owns BLOCK_M rows of
one group; a backward program walks a range of row blocks, recomputing the statistics, and sums
the weight gradient over them in registers: one float32 partial per program, not per row block.
"""

import torch
import triton
import triton.language as tl

from . import common


def _launch(group_size):
    """(BLOCK_M, BLOCK_G, num_warps): tiles of at least 2048 elements (whole rows of one group),
    about 8 per thread, so a program's live tiles stay within 128 registers (16 warps per SM)."""
    block_g = common.block(group_size, lo=1)
    block_m = max(1, 2048 // block_g)
    return block_m, block_g, max(4, min(16, block_m * block_g // 256))


def _programs(rows, block_m, ngroups, device):
    """(programs along the rows, row blocks each): enough programs to fill the GPU a few times,
    so the weight-gradient partials are (programs, n), not (rows / BLOCK_M, n)."""
    blocks = triton.cdiv(rows, block_m)
    target = max(1, 4 * common.multiprocessors(device) // ngroups)
    per = triton.cdiv(blocks, min(blocks, target))
    return triton.cdiv(blocks, per), per


def _rows(t, n):
    """t as (rows, n) with unit stride along n: a view when t's layout allows (e.g. a column slice)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows,
    group_size,
    eps,
    sxr,
    szr,
    sor,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_G)
    c = tl.program_id(1) * group_size + j
    c_mask = j < group_size
    mask = (r < rows)[:, None] & c_mask[None, :]
    v = tl.load(x_ptr + r[:, None] * sxr + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + r[:, None] * szr + c[None, :], mask=mask, other=0.0).to(tl.float32)
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
    tl.store(out_ptr + r[:, None] * sor + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    b_ptr,
    dy_ptr,
    dx_ptr,
    dz_ptr,
    dw_ptr,
    db_ptr,
    rows,
    n,
    group_size,
    eps,
    blocks_per_program,
    sxr,
    szr,
    sdyr,
    sdxr,
    sdzr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """dx, dz for blocks_per_program consecutive row blocks, and this program's sums of dweight /
    dbias over them (row pid0 of (programs, n)), accumulated in registers."""
    pid_m = tl.program_id(0)
    j = tl.arange(0, BLOCK_G)
    c = tl.program_id(1) * group_size + j
    c_mask = j < group_size
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)
    for i in range(blocks_per_program):
        r = (pid_m.to(tl.int64) * blocks_per_program + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (r < rows)[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + r[:, None] * sxr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        v = x
        dy = tl.load(dy_ptr + r[:, None] * sdyr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + r[:, None] * szr + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            if not NORM_BEFORE_GATE:
                v = x * z * sig
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / group_size + eps)
        vhat = v * rstd[:, None]
        if HAS_Z:
            if NORM_BEFORE_GATE:
                yn = vhat * w[None, :]
                if HAS_BIAS:
                    yn += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                dz = dy * yn * sig * (1.0 + z * (1.0 - sig))
                tl.store(dz_ptr + r[:, None] * sdzr + c[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
                dy = dy * z * sig
        dw_acc += dy * vhat
        if HAS_BIAS:
            db_acc += dy
        dvhat = dy * w[None, :]
        dv = rstd[:, None] * (dvhat - vhat * (tl.sum(dvhat * vhat, axis=1) / group_size)[:, None])
        if HAS_Z:
            if not NORM_BEFORE_GATE:
                dz = dv * x * sig * (1.0 + z * (1.0 - sig))
                tl.store(dz_ptr + r[:, None] * sdzr + c[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
                dv = dv * z * sig
        tl.store(dx_ptr + r[:, None] * sdxr + c[None, :], dv.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid_m * n + c, tl.sum(dw_acc, axis=0), mask=c_mask)
    if HAS_BIAS:
        tl.store(db_ptr + pid_m * n + c, tl.sum(db_acc, axis=0), mask=c_mask)


def _group_size(x, weight, bias, z, group_size):
    """group_size (the last dim when None), after checking the arguments' shapes."""
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
    return group_size


def forward(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """The gated norm of x, contiguous, in x's dtype."""
    group_size = _group_size(x, weight, bias, z, group_size)
    shape = x.shape
    n = shape[-1]
    x2 = _rows(x, n)
    z2 = _rows(z, n) if z is not None else None
    rows = x2.shape[0]
    out = common.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_m, block_g, warps = _launch(group_size)
    grid = (triton.cdiv(rows, block_m), n // group_size)
    _norm_fwd_kernel[grid](
        x2,
        z2,
        weight,
        bias,
        out,
        rows,
        group_size,
        eps,
        x2.stride(0),
        z2.stride(0) if z2 is not None else 0,
        out.stride(0),
        HAS_Z=z is not None,
        HAS_BIAS=bias is not None,
        NORM_BEFORE_GATE=norm_before_gate,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        num_warps=warps,
    )
    return out.reshape(shape)


def backward(dout, x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """(dx, dweight, dbias or None, dz or None), dx and dz contiguous."""
    shape = x.shape
    n = shape[-1]
    group_size = n if group_size is None else group_size
    x2 = _rows(x, n)
    z2 = _rows(z, n) if z is not None else None
    rows = x2.shape[0]
    dy = _rows(dout, n)
    block_m, block_g, warps = _launch(group_size)
    programs, per = _programs(rows, block_m, n // group_size, x2.device)
    dx = common.empty(x2.shape, device=x2.device, dtype=x2.dtype)
    dz = common.empty(x2.shape, device=x2.device, dtype=z2.dtype) if z2 is not None else None
    dw_part = common.empty((programs, n), device=x2.device, dtype=torch.float32)
    db_part = common.empty((programs, n), device=x2.device, dtype=torch.float32) if bias is not None else None
    _norm_bwd_kernel[(programs, n // group_size)](
        x2,
        z2,
        weight,
        bias,
        dy,
        dx,
        dz,
        dw_part,
        db_part,
        rows,
        n,
        group_size,
        eps,
        per,
        x2.stride(0),
        z2.stride(0) if z2 is not None else 0,
        dy.stride(0),
        dx.stride(0),
        dz.stride(0) if dz is not None else 0,
        HAS_Z=z2 is not None,
        HAS_BIAS=bias is not None,
        NORM_BEFORE_GATE=norm_before_gate,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        num_warps=warps,
    )
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    dz = dz.reshape(shape) if dz is not None else None
    return dx.reshape(shape), dweight, dbias, dz


class _RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z, eps, group_size, norm_before_gate):
        ctx.save_for_backward(x, weight, bias, z)
        ctx.meta = (eps, group_size, norm_before_gate)
        return forward(x, weight, bias, z, eps, group_size, norm_before_gate)

    @staticmethod
    def backward(ctx, dout):
        return *backward(dout, *ctx.saved_tensors, *ctx.meta), None, None, None


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMSNorm of x over groups of group_size channels of the last dim, gated by silu(z)."""
    return _RMSNormGated.apply(x, weight, bias, z, eps, group_size, norm_before_gate)
