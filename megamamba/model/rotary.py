"""Rotary position embedding on the first channels of each attention head, as flash_attn's RotaryEmbedding.

Channels [0, dim) of a head rotate by position x frequency, frequencies base^(-2i/dim); the rest pass
unchanged. Non-interleaved (GPT-NeoX) pairs channel i with i + dim/2; interleaved (GPT-J) pairs 2i
with 2i + 1. Computed in float32 (or wider) and returned in the input's dtype. No buffers: the angles
come from the positions on every call, so a context-parallel slice rotates by its global positions.
"""

import torch


def rotate(x: torch.Tensor, positions: torch.Tensor, dim: int, base: float, interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, head_dim) at `positions` (seqlen,) -> x with channels [0, dim) rotated."""
    if dim == 0:
        return x
    ct = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** -(torch.arange(0, dim, 2, device=x.device, dtype=ct) / dim)
    angles = positions.to(ct)[:, None] * inv_freq  # (seqlen, dim / 2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # broadcast over heads
    rot, rest = x[..., :dim].to(ct), x[..., dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)
