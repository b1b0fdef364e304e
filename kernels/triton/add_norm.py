"""Residual add + RMSNorm in one pass (the pre-norm of a Mamba block): forward and backward.

r = x + residual is rounded to its dtype and written once as the new residual (float32 when the
model keeps the residual in float32); the norm reads r in the weight's dtype and writes
rmsnorm(r) * weight in that dtype, as `norm(r.to(weight.dtype))` does, so the model's roundings
are unchanged. The backward reads r, the two output gradients and writes the input gradients
once, the norm's gradient rounded to the weight's dtype before the residual's is added, as
autograd would; the weight gradient is summed per program (see `norm`).
"""

import torch
import triton
import triton.language as tl

from ..reference.add_norm import add_rmsnorm as reference_add_rmsnorm
from . import common
from .norm import _launch, _programs, _rows


@triton.jit
def _add_norm_fwd_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    rows,
    n,
    eps,
    sxr,
    srr,
    sor,
    sror,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    c_mask = c < n
    mask = (r < rows)[:, None] & c_mask[None, :]
    v = tl.load(x_ptr + r[:, None] * sxr + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the sum, rounded to its dtype (the new residual's)
        v += tl.load(res_ptr + r[:, None] * srr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        v = v.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    if STORE_RES:
        tl.store(res_out_ptr + r[:, None] * sror + c[None, :], v.to(res_out_ptr.dtype.element_ty), mask=mask)
    v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / n + eps)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + r[:, None] * sor + c[None, :],
        (v * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _add_norm_bwd_kernel(
    r_ptr,
    w_ptr,
    dy_ptr,
    dres_ptr,
    dx_ptr,
    dresin_ptr,
    dw_ptr,
    rows,
    n,
    eps,
    blocks_per_program,
    srr,
    sdyr,
    sdrr,
    sdxr,
    sdir,
    HAS_RES: tl.constexpr,
    HAS_DRES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dx (and d residual) for blocks_per_program row blocks; this program's dweight sum (row pid)."""
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    c_mask = c < n
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(blocks_per_program):
        r = (pid.to(tl.int64) * blocks_per_program + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (r < rows)[:, None] & c_mask[None, :]
        v = tl.load(r_ptr + r[:, None] * srr + c[None, :], mask=mask, other=0.0)
        v = v.to(w_ptr.dtype.element_ty).to(tl.float32)
        dy = tl.load(dy_ptr + r[:, None] * sdyr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / n + eps)
        vhat = v * rstd[:, None]
        dw_acc += dy * vhat
        dvhat = dy * w[None, :]
        dv = rstd[:, None] * (dvhat - vhat * (tl.sum(dvhat * vhat, axis=1) / n)[:, None])
        dv = dv.to(w_ptr.dtype.element_ty).to(tl.float32)
        if HAS_DRES:
            dres = tl.load(dres_ptr + r[:, None] * sdrr + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:  # summed in the new residual's dtype (that of x + residual)
                dv = (dv + dres).to(dres_ptr.dtype.element_ty).to(tl.float32)
            else:  # both paths reach x through casts to its dtype
                dv = dv.to(dx_ptr.dtype.element_ty).to(tl.float32) + dres.to(dx_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dx_ptr + r[:, None] * sdxr + c[None, :], dv.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(dresin_ptr + r[:, None] * sdir + c[None, :], dv.to(dresin_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * n + c, tl.sum(dw_acc, axis=0), mask=c_mask)


_FUSED = (torch.float32, torch.bfloat16, torch.float16)


def fused(x, residual, weight, residual_dtype) -> bool:
    """Whether the kernel takes these arguments (their shapes checked first): r's dtype is the new
    residual's or there is no add (the model's cases), in float32, bfloat16 or float16; other dtype
    combinations take the reference."""
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    residual_dtype = sum_dtype if residual_dtype is None else residual_dtype
    dtypes = {x.dtype, weight.dtype, residual_dtype} | ({residual.dtype} if residual is not None else set())
    return dtypes <= set(_FUSED) and (residual is None or residual_dtype == sum_dtype)


def forward(x, residual, weight, eps, residual_dtype):
    """(rmsnorm(r) in weight's dtype, r in residual_dtype or None when it is x itself), r = x (+ residual);
    residual_dtype resolved (not None), the arguments `fused`."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x, n)
    res2 = _rows(residual, n) if residual is not None else None
    rows = x2.shape[0]
    store_res = residual is not None or residual_dtype != x.dtype
    out = common.empty((rows, n), device=x.device, dtype=weight.dtype)
    res_out = common.empty((rows, n), device=x.device, dtype=residual_dtype) if store_res else None
    block_m, block_n, warps = _launch(n)
    _add_norm_fwd_kernel[(triton.cdiv(rows, block_m),)](
        x2,
        res2,
        weight,
        out,
        res_out,
        rows,
        n,
        eps,
        x2.stride(0),
        res2.stride(0) if res2 is not None else 0,
        out.stride(0),
        res_out.stride(0) if store_res else 0,
        HAS_RES=residual is not None,
        STORE_RES=store_res,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return out.reshape(shape), res_out.reshape(shape) if store_res else None


def backward(dout, dres, r, weight, eps, x_dtype, residual_in_dtype):
    """(dx, dresidual or None, dweight) from r = x (+ residual) as the forward stored it (x when it did
    not); dout or dres None: that output is unused. residual_in_dtype: the residual input's, None without."""
    shape, n = r.shape, r.shape[-1]
    r2 = _rows(r, n)
    rows = r2.shape[0]
    dy = _rows(dout, n) if dout is not None else torch.zeros_like(r2, dtype=weight.dtype)
    dres2 = _rows(dres, n) if dres is not None else None
    block_m, block_n, warps = _launch(n)
    programs, per = _programs(rows, block_m, 1, r2.device)
    dx = common.empty((rows, n), device=r2.device, dtype=x_dtype)
    dresin = common.empty((rows, n), device=r2.device, dtype=residual_in_dtype) if residual_in_dtype else None
    dw_part = common.empty((programs, n), device=r2.device, dtype=torch.float32)
    _add_norm_bwd_kernel[(programs,)](
        r2,
        weight,
        dy,
        dres2,
        dx,
        dresin,
        dw_part,
        rows,
        n,
        eps,
        per,
        r2.stride(0),
        dy.stride(0),
        dres2.stride(0) if dres2 is not None else 0,
        dx.stride(0),
        dresin.stride(0) if dresin is not None else 0,
        HAS_RES=residual_in_dtype is not None,
        HAS_DRES=dres2 is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    dresin = dresin.reshape(shape) if dresin is not None else None
    return dx.reshape(shape), dresin, dw_part.sum(0).to(weight.dtype)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, residual_dtype):
        out, res_out = forward(x, residual, weight, eps, residual_dtype)
        ctx.save_for_backward(x if res_out is None else res_out, weight)
        ctx.meta = (eps, x.dtype, None if residual is None else residual.dtype)
        ctx.set_materialize_grads(False)
        return out if res_out is None else (out, res_out)

    @staticmethod
    def backward(ctx, dout, dres=None):
        r, weight = ctx.saved_tensors
        dx, dresin, dweight = backward(dout, dres, r, weight, *ctx.meta)
        return dx, dresin, dweight, None, None


def add_rmsnorm(x, residual, weight, eps=1e-6, residual_dtype=None):
    """(rmsnorm(r) in weight's dtype, r in residual_dtype), r = x (+ residual); see the reference.

    Fused when `fused` allows the dtypes (the model's cases); other combinations, and float64, take
    the reference.
    """
    if not fused(x, residual, weight, residual_dtype):
        return reference_add_rmsnorm(x, residual, weight, eps=eps, residual_dtype=residual_dtype)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    residual_dtype = sum_dtype if residual_dtype is None else residual_dtype
    if residual is None and residual_dtype == x.dtype:
        return _AddRMSNorm.apply(x, None, weight, eps, residual_dtype), x
    return _AddRMSNorm.apply(x, residual, weight, eps, residual_dtype)
