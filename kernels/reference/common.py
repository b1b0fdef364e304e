"""Helpers shared by the reference ops: compute dtype, argument checks, document ids."""

import torch
import torch.nn.functional as F


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64, everything else in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_shape(name: str, t: torch.Tensor, expected: tuple, meaning: str) -> None:
    """Raise ValueError unless t has shape `expected` (described by `meaning`)."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(t.shape)}")


def check_real(name: str, t: torch.Tensor) -> None:
    """Raise ValueError for complex or integer tensors where a real float is required."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a real floating-point tensor, got dtype {t.dtype}")


def silu(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sigmoid(v)


def document_ids(seq_idx, batch: int, seqlen: int):
    """Per-position document counters (batch, seqlen) int64, or None without seq_idx.

    The counter grows by one wherever seq_idx differs from the previous position, so equal
    counters mean "no boundary in between" even if a caller reuses an id for a later document.
    """
    if seq_idx is None:
        return None
    check_shape("seq_idx", seq_idx, (batch, seqlen), "(batch, seqlen)")
    if seq_idx.is_floating_point() or seq_idx.is_complex():
        raise ValueError(f"seq_idx must hold integer document ids, got dtype {seq_idx.dtype}")
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).long()
    return F.pad(changes.cumsum(1), (1, 0))


def pad_time(t: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """Append `pad` zeros along dimension `dim` (a no-op for pad == 0)."""
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_documents(doc: torch.Tensor, pad: int) -> torch.Tensor:
    """Extend (batch, seqlen) document counters by repeating the last one."""
    if pad == 0:
        return doc
    return torch.cat([doc, doc[:, -1:].expand(-1, pad)], dim=1)
