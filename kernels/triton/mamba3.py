"""Mamba-3's scan on Triton, SISO and MIMO: the exponential-trapezoidal recurrence run by the Mamba-2 SSD
kernels (ssd.py).

Token s enters the state twice: with γ_s = λ_sΔ_s at its own step and, through the next token's
trapezoid term, with (1 - λ_{s+1})Δ_{s+1}α_{s+1} one step later. α_{s+1} is that step's own decay,
so both ride one key, B̂_s scaled by w_s = γ_s + ν_s with ν_s = (1 - λ_{s+1})Δ_{s+1} (0 where token s
ends its document or the sequence). The SSD's decay exp(dt·A) with A = -1 and dt = -Δ_t A_t is the
per-token decay; its input scale dt is divided out of the key. A MIMO token of rank R is R SSD steps,
its channels in order: the first decays by α_s, the others not at all (the step floor), so the SSD
runs R·seqlen steps in chunks of R·chunk_size. Each SSD step reads the state after its own channel,
while the recurrence reads it after the token's ν-weighted previous and γ-weighted current channels:
the intra-token correction y_{s,r} += Σ_{r'>r} γ_s (Ĉ_{s,r}·B̂_{s,r'}) x_{s,r'} - Σ_{r'≤r} ν_s (Ĉ_{s,r}·B̂_{s,r'})
x_{s,r'} fixes that (for SISO, the diagonal y_s -= ν_s (Ĉ_s·B̂_s) x_s). The initial state's previous
token folds into the initial SSM state. The backward runs the SSD's backward kernels and the chain rule
through these elementwise steps, written out.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..reference.common import compute_dtype
from ..reference.mamba3 import ScanState, _check
from . import ssd

# The smallest step -Δ·A the SSD is given, and the step of a MIMO token's channels after its first: a Δ
# that underflowed to 0 would otherwise divide 0 by 0 in the key. exp(-1e-20) is 1 in float32, as
# exp(Δ·A) is for any Δ·A above -1e-20.
STEP_FLOOR = 1e-20


class _Folded(NamedTuple):
    """The scan in the compute dtype: x, B̂, Ĉ (batch, seqlen, nheads, rank, ·); Δ, A, λ, ν (the next
    token's weight) (batch, seqlen, nheads); the SSD's step of each channel -Δ·A (its first) or the floor
    (the others), and ratio = (λΔ + ν) / step, the key's scale (batch, seqlen, nheads, rank)."""

    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    lam: torch.Tensor
    nu: torch.Tensor
    step: torch.Tensor
    ratio: torch.Tensor


def _steps(t: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, nheads, rank, ·) or (batch, seqlen, nheads, rank) -> the SSD's steps (batch,
    seqlen·rank, nheads, ·), a token's channels in order."""
    return t.transpose(2, 3).flatten(1, 2)


def _channels(t: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of `_steps` for (batch, seqlen·rank, nheads, ·)."""
    return t.unflatten(1, (-1, rank)).transpose(2, 3)


def _next_weight(dt, lam, continues):
    """ν_s = (1 - λ_{s+1})Δ_{s+1}: 0 at the sequence's last token and where token s+1 starts a document."""
    nu = F.pad(((1 - lam) * dt)[:, 1:], (0, 0, 0, 1))
    return nu if continues is None else nu * continues


def _continues(seq_idx):
    """(batch, seqlen, 1): 1 where the next token is in the same document (and exists), else 0; None
    without documents."""
    if seq_idx is None:
        return None
    return F.pad((seq_idx[:, 1:] == seq_idx[:, :-1]).float(), (0, 1))[..., None]


def _fold(x, dt, A, lam, B, C, continues) -> _Folded:
    ct = compute_dtype(x)
    x, B, C, dt, A, lam = (t.to(ct) for t in (x, B, C, dt, A, lam))
    first = (-dt * A).clamp_min(STEP_FLOOR)[..., None]
    step = torch.cat([first, first.new_full((*first.shape[:3], x.shape[3] - 1), STEP_FLOOR)], dim=3)
    nu = _next_weight(dt, lam, continues)
    return _Folded(x, B, C, dt, A, lam, nu, step, (lam * dt + nu)[..., None] / step)


def _first_weight(f: _Folded):
    """(1 - λ_0)Δ_0 (batch, nheads, 1, 1): the weight of the initial state's previous token."""
    return ((1 - f.lam[:, 0]) * f.dt[:, 0])[..., None, None]


def _folded_initial_state(initial_state, f: _Folded):
    """The initial SSM state with its previous token's trapezoid term, (1 - λ_0)Δ_0 Σ_r x_{-1,r} B̂_{-1,r}ᵀ,
    added: the first step's decay α_0 then applies to both, as in the recurrence."""
    ssm, x, B = (t.to(f.x.dtype) for t in initial_state)
    return ssm + _first_weight(f) * torch.einsum("bhrp,bhrn->bhpn", x, B)


def _ssd_arguments(f: _Folded, initial_state, chunk_size, D, seq_idx):
    """ssd.forward's and ssd.backward's arguments by name (ssd.backward's output gradients aside)."""
    rank = f.x.shape[3]
    return dict(
        x=_steps(f.x),
        dt=_steps(f.step),
        A=-torch.ones(f.x.shape[2], device=f.x.device),
        B=_steps(f.B * f.ratio[..., None]),
        C=_steps(f.C),
        chunk_size=chunk_size * rank,
        D=D,
        z=None,
        dt_bias=None,
        initial_states=None if initial_state is None else _folded_initial_state(initial_state, f),
        seq_idx=None if seq_idx is None else seq_idx.repeat_interleave(rank, dim=1),
        dt_softplus=False,
        dt_limit=(0.0, math.inf),
    )


def _correction_weights(f: _Folded):
    """(batch, seqlen, nheads, rank, rank): γ_s where the key channel r' comes after the reading channel r,
    -ν_s where it does not; and that pattern, `later` (rank, rank)."""
    rank = f.x.shape[3]
    later = torch.ones(rank, rank, dtype=torch.bool, device=f.x.device).triu(1)
    gamma = (f.lam * f.dt)[..., None, None]
    return torch.where(later, gamma, -f.nu[..., None, None]), later


def forward(x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None):
    """(y, the final ssm, x and B̂), all in x's compute dtype; arguments as the reference's
    `mamba3_scan_chunked`. Like the reference, it computes in float32 for bf16 inputs: the SSD run on
    bf16 rounds its output and that output's gradient to bf16, which doubled the errors of dΔ and dA and
    took dD from float32 round-off to bf16's."""
    _check(x, dt, A, lam, B, C, D, initial_state)
    f = _fold(x, dt, A, lam, B, C, _continues(seq_idx))
    y, ssm = ssd.forward(**_ssd_arguments(f, initial_state, chunk_size, D, seq_idx))
    weights, _ = _correction_weights(f)
    scores = torch.einsum("blhrn,blhsn->blhrs", f.C, f.B)
    y = _channels(y, x.shape[3]) + torch.einsum("blhrs,blhsp->blhrp", weights * scores, f.x)
    ct = f.x.dtype
    return y, ssm.to(ct), x[:, -1].to(ct, copy=True), B[:, -1].to(ct, copy=True)


def backward(dy, dssm, dlast_x, dlast_B, x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None):
    """(dx, ddt, dA, dlam, dB, dC, dD, d initial ssm, x and B̂), None for an absent input, given the
    gradients of `forward`'s outputs (None: unused)."""
    continues = _continues(seq_idx)
    f = _fold(x, dt, A, lam, B, C, continues)
    rank = x.shape[3]
    dy = torch.zeros_like(f.x) if dy is None else dy.to(f.x.dtype)
    batch, seqlen, nheads = dt.shape
    nchunks = -(-seqlen // chunk_size)
    dlog = torch.zeros(batch, nheads, nchunks, chunk_size * rank, device=x.device)
    dxs, _, _, dkeys, dCs, dD, _, _, dfolded = ssd.backward(
        _steps(dy), dssm, **_ssd_arguments(f, initial_state, chunk_size, D, seq_idx), log_decay_grad=dlog
    )
    # The gradient of the log-decay ΔA, carried by each token's first channel, apart from that of the
    # SSD's step as the input's scale, which the key's division by the step cancels. Where the step is
    # floored, exp(ΔA) and exp(-floor) are both 1 in float32: the floored step's log-decay gradient is ΔA's.
    da = dlog.flatten(2)[:, :, : seqlen * rank].unflatten(2, (seqlen, rank))[..., 0].transpose(1, 2).contiguous()
    dx, dkeys, dC = (_channels(g, rank) for g in (dxs, dkeys, dCs))
    # The intra-token correction y_r += Σ_r' weight_{r,r'} (Ĉ_r·B̂_r') x_r': its gradient through the
    # weights (γ, ν), Ĉ, B̂ and x.
    weights, later = _correction_weights(f)
    scores = torch.einsum("blhrn,blhsn->blhrs", f.C, f.B)
    reads = torch.einsum("blhrp,blhsp->blhrs", dy, f.x)  # d(weight · score)
    dx = dx + torch.einsum("blhrs,blhrp->blhsp", weights * scores, dy)
    dscores = weights * reads
    dC = dC + torch.einsum("blhrs,blhsn->blhrn", dscores, f.B)
    dB = torch.einsum("blhrs,blhrn->blhsn", dscores, f.C)
    dweights = scores * reads
    dgamma = (dweights * later).sum((-2, -1))
    dnu = -(dweights * ~later).sum((-2, -1))
    # keys = B̂ ratio, ratio = (λΔ + ν) / step, step = max(-ΔA, floor) or the floor.
    dB = dB + dkeys * f.ratio[..., None]
    dweight = ((dkeys * f.B).sum(-1) / f.step).sum(-1)  # d(λΔ + ν)
    dgamma = dgamma + dweight
    dnu = dnu + dweight
    if continues is not None:
        dnu = dnu * continues
    dnext = F.pad(dnu[:, :-1], (0, 0, 1, 0))  # ν_{s} belongs to token s + 1
    ddt = dgamma * f.lam + da * f.A + dnext * (1 - f.lam)
    dlam = dgamma * f.dt - dnext * f.dt
    dA = da * f.dt
    if dlast_x is not None:
        dx[:, -1] += dlast_x
    if dlast_B is not None:
        dB[:, -1] += dlast_B
    dinitial = (None, None, None)
    if initial_state is not None:
        _, x0, B0 = (t.to(f.x.dtype) for t in initial_state)
        weight = _first_weight(f)
        dx0 = weight * torch.einsum("bhpn,bhrn->bhrp", dfolded, B0)
        dB0 = weight * torch.einsum("bhpn,bhrp->bhrn", dfolded, x0)
        dw0 = torch.einsum("bhpn,bhrp,bhrn->bh", dfolded, x0, B0)
        ddt[:, 0] += dw0 * (1 - f.lam[:, 0])
        dlam[:, 0] -= dw0 * f.dt[:, 0]
        dinitial = tuple(g.to(t.dtype) for g, t in zip((dfolded, dx0, dB0), initial_state))
    grads = (dx.to(x.dtype), ddt.to(dt.dtype), dA.to(A.dtype), dlam.to(lam.dtype), dB.to(B.dtype), dC.to(C.dtype))
    return (*grads, dD, *dinitial)


class _Mamba3Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx, chunk_size):
        ctx.save_for_backward(x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        initial = None if initial_ssm is None else ScanState(initial_ssm, initial_x, initial_B)
        return forward(x, dt, A, lam, B, C, chunk_size, D, initial, seq_idx)

    @staticmethod
    def backward(ctx, dy, dssm, dlast_x, dlast_B):
        x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx = ctx.saved_tensors
        initial = None if initial_ssm is None else ScanState(initial_ssm, initial_x, initial_B)
        grads = backward(dy, dssm, dlast_x, dlast_B, x, dt, A, lam, B, C, ctx.chunk_size, D, initial, seq_idx)
        return *grads, None, None


def mamba3_scan(x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, return_final_state=False):
    """The scan, SISO or MIMO, with the arguments and results of the reference's `mamba3_scan_chunked`."""
    initial = (None, None, None) if initial_state is None else tuple(initial_state)
    y, ssm, last_x, last_B = _Mamba3Scan.apply(x, dt, A, lam, B, C, D, *initial, seq_idx, chunk_size)
    return (y, ScanState(ssm, last_x, last_B)) if return_final_state else y
