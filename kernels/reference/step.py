"""Single-token recurrent steps for generation; they update the cached state in place.

Plain torch, so they serve CUDA tensors too. Computed in float32 (float64 for float64 x).
"""

import torch

from .common import check_shape, compute_dtype, silu
from .conv import check_activation


def _as_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Bring the Mamba-1 form (state (batch, dim, dstate)) to the Mamba-2 form with headdim 1.

    Channels then play the role of heads, so B/C groups split the channels as in selective_scan.
    """
    if state.dim() == 4:
        return state, x, dt, A, B, C, D, z, dt_bias
    if state.dim() != 3:
        raise ValueError(
            f"state must have shape (batch, dim, dstate) or (batch, nheads, headdim, dstate), got {tuple(state.shape)}"
        )

    def col(t):
        return None if t is None else t.unsqueeze(-1)

    A = A.unsqueeze(1) if A.dim() == 2 else A
    B = B.unsqueeze(1) if B.dim() == 2 else B
    C = C.unsqueeze(1) if C.dim() == 2 else C
    return state.unsqueeze(2), col(x), col(dt), A, B, C, col(D), col(z), col(dt_bias)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One step of h = exp(dt A) h + dt x B^T, y = h C (+ D x) (* silu z); writes h into `state`.

    Mamba-1 form: state (batch, dim, dstate), x/dt/z (batch, dim), A (dim, dstate), B/C (batch, dstate)
    or (batch, ngroups, dstate), D/dt_bias (dim,). Mamba-2 form: state (batch, nheads, headdim, dstate),
    x/dt/z (batch, nheads, headdim), A (nheads, headdim, dstate), B/C (batch, ngroups, dstate),
    D/dt_bias (nheads, headdim). Returns y shaped like x.
    """
    mamba1 = state.dim() == 3
    s, xh, dth, Ah, Bh, Ch, Dh, zh, bh = _as_heads(state, x, dt, A, B, C, D, z, dt_bias)
    batch, nheads, headdim, dstate = s.shape
    unit = "dim" if mamba1 else "nheads, headdim"
    lead = (batch, nheads) if mamba1 else (batch, nheads, headdim)
    check_shape("x", x, lead, f"(batch, {unit})")
    check_shape("dt", dt, lead, f"(batch, {unit})")
    check_shape("A", A, lead[1:] + (dstate,), f"({unit}, dstate)")
    if Bh.dim() != 3 or Bh.shape[0] != batch or Bh.shape[2] != dstate:
        raise ValueError(
            f"B must have shape (batch, dstate) or (batch, ngroups, dstate) with batch = {batch}, "
            f"dstate = {dstate}, got {tuple(B.shape)}"
        )
    ngroups = Bh.shape[1]
    if nheads % ngroups != 0:
        raise ValueError(f"B has {ngroups} groups, which must divide {'dim' if mamba1 else 'nheads'} ({nheads})")
    check_shape("C", C, B.shape, "B.shape")
    if D is not None:
        check_shape("D", D, lead[1:], f"({unit})")
    if z is not None:
        check_shape("z", z, lead, f"(batch, {unit})")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, lead[1:], f"({unit})")

    ct = compute_dtype(x)
    step = dth.to(ct)
    if bh is not None:
        step = step + bh.to(ct)
    if dt_softplus:
        step = torch.nn.functional.softplus(step)
    per_group = nheads // ngroups
    Bx = Bh.to(ct).repeat_interleave(per_group, dim=1)[:, :, None, :]  # (b, h, 1, n)
    Cx = Ch.to(ct).repeat_interleave(per_group, dim=1)[:, :, None, :]
    new = s.to(ct) * torch.exp(step[..., None] * Ah.to(ct)) + (step * xh.to(ct))[..., None] * Bx
    s.copy_(new)
    y = (new * Cx).sum(-1)
    if Dh is not None:
        y = y + Dh.to(ct) * xh.to(ct)
    if zh is not None:
        y = y * silu(zh.to(ct))
    y = y.to(x.dtype)
    return y.squeeze(-1) if mamba1 else y


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Shift conv_state (batch, dim, width) left, append x (batch, dim), return the conv output (batch, dim)."""
    if x.dim() != 2:
        raise ValueError(f"x must have shape (batch, dim), got {tuple(x.shape)}")
    batch, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must have shape (dim, width) with dim = {dim}, got {tuple(weight.shape)}")
    width = weight.shape[1]
    check_shape("conv_state", conv_state, (batch, dim, width), "(batch, dim, width)")
    if bias is not None:
        check_shape("bias", bias, (dim,), "(dim,)")
    check_activation(activation)
    ct = compute_dtype(x)
    window = torch.cat([conv_state[:, :, 1:].to(ct), x.to(ct)[:, :, None]], dim=-1)
    conv_state.copy_(window)
    out = (window * weight.to(ct)).sum(-1)
    if bias is not None:
        out = out + bias.to(ct)
    if activation is not None:
        out = silu(out)
    return out.to(x.dtype)
