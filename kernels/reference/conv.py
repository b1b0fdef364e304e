"""Depthwise causal 1-D convolution in PyTorch."""

import torch
import torch.nn.functional as F

from .common import check_real, check_shape, compute_dtype, document_ids, silu

ACTIVATIONS = (None, "silu", "swish")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """out_t = sum_k weight[:, k] x_{t-width+1+k} (+ bias), then silu if asked; see megamamba.kernels.

    With seq_idx, each output only reads taps from its own document: a window is unfolded
    per position and taps from an earlier document are masked out.
    """
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, dim, seqlen), got {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must have shape (dim, width) with dim = {dim}, got {tuple(weight.shape)}")
    if bias is not None:
        check_shape("bias", bias, (dim,), "(dim,)")
    check_activation(activation)
    check_real("x", x)
    check_real("weight", weight)
    out_dtype, ct = x.dtype, compute_dtype(x)
    width = weight.shape[1]
    xc, w = x.to(ct), weight.to(ct)
    b = None if bias is None else bias.to(ct)
    doc = document_ids(seq_idx, batch, seqlen)
    if doc is None:
        out = F.conv1d(xc, w.unsqueeze(1), b, padding=width - 1, groups=dim)[..., :seqlen]
    else:
        windows = F.pad(xc, (width - 1, 0)).unfold(-1, width, 1)  # (b, d, L, w)
        tap_doc = F.pad(doc, (width - 1, 0), value=-1).unfold(-1, width, 1)  # (b, L, w)
        same = (tap_doc == doc[..., None]).to(ct)
        out = torch.einsum("bdlw,blw,dw->bdl", windows, same, w)
        if b is not None:
            out = out + b[:, None]
    if activation is not None:
        out = silu(out)
    return out.to(out_dtype)
