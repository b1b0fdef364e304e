"""Gated RMSNorm in PyTorch (as mamba_ssm's rmsnorm_fn)."""

import torch

from .common import check_real, check_shape, compute_dtype, silu


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMS-normalise each group of group_size channels of the last dim, * weight (+ bias), gated by z.

    With z: norm_before_gate gives norm(x) * silu(z), otherwise norm(x * silu(z)).
    Computed in float32 (float64 for float64 x), returned in x's dtype.
    """
    n = x.shape[-1]
    check_shape("weight", weight, (n,), "(hidden,) = x.shape[-1:]")
    if bias is not None:
        check_shape("bias", bias, (n,), "(hidden,) = x.shape[-1:]")
    if z is not None:
        check_shape("z", z, x.shape, "x.shape")
    group_size = n if group_size is None else group_size
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"group_size ({group_size}) must divide the last dim of x ({n})")
    check_real("x", x)
    out_dtype, ct = x.dtype, compute_dtype(x)
    v = x.to(ct)
    if z is not None and not norm_before_gate:
        v = v * silu(z.to(ct))
    grouped = v.reshape(*v.shape[:-1], n // group_size, group_size)
    rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = (grouped * rstd).reshape(v.shape) * weight.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    if z is not None and norm_before_gate:
        out = out * silu(z.to(ct))
    return out.to(out_dtype)
