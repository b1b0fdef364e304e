"""Mamba-3's preprocessing in PyTorch: in_proj's raw columns -> the scan's inputs.

B/C RMSNorm over d_state, the per-head bias, the data-dependent rotation by the cumulative angle
(reset at each document start), Δ, A and the trapezoid weight λ. Kept apart from the scan
(`mamba3.py`) so that a kernel can fuse it there or into one preprocessing kernel.
"""

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .common import check_shape, compute_dtype, document_ids

A_ACTIVATIONS = ("heavy_tail", "softplus")
ROTATIONS = ("adjacent", "halves")  # SISO rotates (2i, 2i+1); MIMO rotates (i, i + d_state/2)


class ScanInputs(NamedTuple):
    """What the Mamba-3 scan reads: B̂, Ĉ (batch, seqlen, nheads, rank, dstate) normed, biased and rotated;
    dt = Δ, A, lam = λ (batch, seqlen, nheads); angle (batch, seqlen, nheads, nangles), the cumulative
    angle modulo 2π (its last position is the angle state)."""

    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    lam: torch.Tensor
    angle: torch.Tensor


def a_activation_fn(name: str, v: torch.Tensor) -> torch.Tensor:
    """f in A = min(-f(dd_A), -A_floor): "heavy_tail" (1 + v for v >= 0, 1 / (1 - v) below) or "softplus"."""
    if name == "heavy_tail":
        return v.clamp_min(0) + 1 / (1 - v.clamp_max(0))
    if name == "softplus":
        return F.softplus(v)
    raise ValueError(f"a_activation={name!r}: choose one of {A_ACTIVATIONS}")


def document_angle(increments: torch.Tensor, doc, initial_angle) -> torch.Tensor:
    """Cumulative sum over the sequence of increments (batch, seqlen, nheads, nangles), restarting at each
    document start (doc: document counters); `initial_angle` (batch, nheads, nangles) continues the first
    document. Reduced modulo 2π."""
    total = increments.cumsum(1)
    if doc is not None:
        batch, seqlen = doc.shape
        positions = torch.arange(seqlen, device=doc.device).expand(batch, seqlen)
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        start = torch.where(starts, positions, 0).cummax(1).values  # each position's document start
        before = (total - increments).gather(1, start[:, :, None, None].expand_as(total))
        total = total - before
    if initial_angle is not None:
        entering = initial_angle[:, None]
        if doc is not None:  # only the first document continues it
            entering = entering * (doc == doc[:, :1]).reshape(*doc.shape, 1, 1)
        total = total + entering
    return torch.remainder(total, 2 * math.pi)


def rotate(v: torch.Tensor, angle: torch.Tensor, rotation: str) -> torch.Tensor:
    """Rotate pairs of the last dim of v (..., dstate) by angle (..., nangles): pair i is (2i, 2i+1)
    ("adjacent") or (i, i + dstate/2) ("halves"); dimensions outside the pairs pass unchanged."""
    nangles, dstate = angle.shape[-1], v.shape[-1]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if rotation == "adjacent":
        first, second = v[..., 0 : 2 * nangles : 2], v[..., 1 : 2 * nangles : 2]
        rotated = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)
        return torch.cat([rotated, v[..., 2 * nangles :]], dim=-1)
    if rotation == "halves":
        half = dstate // 2
        first, second = v[..., :nangles], v[..., half : half + nangles]
        return torch.cat(
            [first * cos - second * sin, v[..., nangles:half], first * sin + second * cos, v[..., half + nangles :]],
            dim=-1,
        )
    raise ValueError(f"rotation={rotation!r}: choose one of {ROTATIONS}")


def _norm(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight


def check_inputs(B, C, dd_dt, dd_A, trap, angles, B_bias, C_bias, initial_angle) -> None:
    """Refuse inputs whose shapes `mamba3_scan_inputs` cannot read, naming the tensor and the shape it needs."""
    batch, seqlen, rank, ngroups, dstate = B.shape
    nheads = dd_dt.shape[-1]
    nangles = angles.shape[-1]
    check_shape("C", C, B.shape, "(batch, seqlen, rank, ngroups, dstate) like B")
    for name, t in (("dd_dt", dd_dt), ("dd_A", dd_A), ("trap", trap)):
        check_shape(name, t, (batch, seqlen, nheads), "(batch, seqlen, nheads)")
    check_shape("B_bias", B_bias, (nheads, rank, dstate), "(nheads, rank, dstate)")
    check_shape("C_bias", C_bias, (nheads, rank, dstate), "(nheads, rank, dstate)")
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    if not 0 < nangles <= dstate // 2:
        raise ValueError(f"angles has {nangles} angles; rotating pairs of dstate={dstate} allows 1 .. {dstate // 2}")
    if initial_angle is not None:
        check_shape("initial_angle", initial_angle, (batch, nheads, nangles), "(batch, nheads, nangles)")


def mamba3_scan_inputs(
    B,
    C,
    dd_dt,
    dd_A,
    trap,
    angles,
    dt_bias,
    B_norm_weight,
    C_norm_weight,
    B_bias,
    C_bias,
    A_floor: float,
    a_activation: str = "heavy_tail",
    rotation: str = "adjacent",
    norm_eps: float = 1e-5,
    seq_idx=None,
    initial_angle: Optional[torch.Tensor] = None,
) -> ScanInputs:
    """in_proj's columns -> ScanInputs, in float32 (float64 for float64 B).

    B, C (batch, seqlen, rank, ngroups, dstate) as in_proj lays them out ("(r g n)"); dd_dt, dd_A, trap
    (batch, seqlen, nheads); angles (batch, seqlen, nangles), shared by the heads; dt_bias (nheads,);
    B_norm_weight, C_norm_weight (dstate,); B_bias, C_bias (nheads, rank, dstate). Head h reads group
    h // (nheads / ngroups). seq_idx (batch, seqlen) document ids restart the angle; initial_angle
    (batch, nheads, nangles) continues the first document's.
    """
    check_inputs(B, C, dd_dt, dd_A, trap, angles, B_bias, C_bias, initial_angle)
    ct = compute_dtype(B)
    batch, seqlen, rank, ngroups, dstate = B.shape
    nheads = dd_dt.shape[-1]

    def heads(v, weight, bias):
        v = _norm(v.to(ct), weight.to(ct), norm_eps).repeat_interleave(nheads // ngroups, dim=3)
        return v.transpose(2, 3) + bias.to(ct)  # (batch, seqlen, nheads, rank, dstate)

    dt = F.softplus(dd_dt.to(ct) + dt_bias.to(ct))
    A = torch.clamp(-a_activation_fn(a_activation, dd_A.to(ct)), max=-A_floor)
    lam = torch.sigmoid(trap.to(ct))
    increments = dt[..., None] * math.pi * torch.tanh(angles.to(ct))[:, :, None, :]
    doc = document_ids(seq_idx, batch, seqlen)
    angle = document_angle(increments, doc, None if initial_angle is None else initial_angle.to(ct))
    Bh = rotate(heads(B, B_norm_weight, B_bias), angle[:, :, :, None], rotation)
    Ch = rotate(heads(C, C_norm_weight, C_bias), angle[:, :, :, None], rotation)
    return ScanInputs(Bh, Ch, dt, A, lam, angle)
