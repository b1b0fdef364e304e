"""Residual add + RMSNorm in PyTorch: the pre-norm of a Mamba block, as the model writes it."""

from .norm import rmsnorm_gated


def add_rmsnorm(x, residual, weight, eps=1e-6, residual_dtype=None):
    """(rmsnorm(r) in weight's dtype, r in residual_dtype) for r = x + residual (x when residual is None).

    The norm reads r cast to weight's dtype, as `norm(r.to(weight.dtype))`; residual_dtype None keeps
    r's own dtype (that of x + residual).
    """
    r = x if residual is None else x + residual
    normed = rmsnorm_gated(r.to(weight.dtype), weight, eps=eps)
    return normed, r if residual_dtype is None else r.to(residual_dtype)
