"""Mamba-3 written literally from its equations, token by token, head by head, in float64: the oracle the
reference scan (both forms) and the model are checked against. Slow on purpose; tiny shapes only."""

import math

import torch
import torch.nn.functional as F


def rotation_pairs(dstate: int, nangles: int, mimo: bool) -> list:
    """The state dimensions angle i rotates: (2i, 2i+1) for SISO, (i, i + dstate/2) for MIMO."""
    return [(i, i + dstate // 2) if mimo else (2 * i, 2 * i + 1) for i in range(nangles)]


def a_of(dd_A, activation: str, A_floor: float):
    f = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - dd_A)) if activation == "heavy_tail" else torch.log1p(dd_A.exp())
    return torch.minimum(-f, torch.full_like(f, -A_floor))


def literal_scan(x, B, C, dd_dt, dd_A, trap, angles, w, *, mimo, activation, A_floor, seq_idx=None, initial=None):
    """x (b, l, h, r, p) the values per rank; B, C (b, l, r, g, n) as in_proj gives them; dd_dt, dd_A, trap
    (b, l, h); angles (b, l, nangles); w: dt_bias, B_norm, C_norm, B_bias, C_bias, D. initial: (angle
    (b, h, nangles), ssm (b, h, p, n), previous x (b, h, r, p), previous B̂ (b, h, r, n)). Returns y
    (b, l, h, r, p) = h_t Ĉ_{t,r} + D x_{t,r} and the final (angle, ssm, x, B̂)."""
    b, length, h, r, p = x.shape
    g, n = B.shape[3], B.shape[4]
    pairs = rotation_pairs(n, angles.shape[-1], mimo)
    if initial is None:
        zeros = x.new_zeros
        initial = (zeros(b, h, len(pairs)), zeros(b, h, p, n), zeros(b, h, r, p), zeros(b, h, r, n))
    angle, ssm, prev_x, prev_B = (t.clone() for t in initial)
    y = x.new_zeros(b, length, h, r, p)
    for t in range(length):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).double()
            angle, ssm = angle * keep[:, None, None], ssm * keep[:, None, None, None]
            prev_x, prev_B = prev_x * keep[:, None, None, None], prev_B * keep[:, None, None, None]
        dt = F.softplus(dd_dt[:, t] + w["dt_bias"])  # (b, h)
        A = a_of(dd_A[:, t], activation, A_floor)
        lam = torch.sigmoid(trap[:, t])
        angle = angle + dt[:, :, None] * math.pi * torch.tanh(angles[:, t])[:, None, :]
        B_hat, C_hat = x.new_zeros(b, h, r, n), x.new_zeros(b, h, r, n)
        for head in range(h):
            group = head // (h // g)
            for out, raw, norm, bias in ((B_hat, B, w["B_norm"], w["B_bias"]), (C_hat, C, w["C_norm"], w["C_bias"])):
                v = raw[:, t, :, group]  # (b, r, n)
                v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * norm + bias[head]
                rotated = v.clone()
                for i, (j, k) in enumerate(pairs):
                    c, s = torch.cos(angle[:, head, i])[:, None], torch.sin(angle[:, head, i])[:, None]
                    rotated[..., j], rotated[..., k] = c * v[..., j] - s * v[..., k], s * v[..., j] + c * v[..., k]
                out[:, head] = rotated
        alpha = torch.exp(dt * A)[:, :, None, None]
        beta = ((1 - lam) * dt)[:, :, None, None] * alpha
        gamma = (lam * dt)[:, :, None, None]
        outer_prev = torch.einsum("bhrp,bhrn->bhpn", prev_x, prev_B)
        outer_now = torch.einsum("bhrp,bhrn->bhpn", x[:, t], B_hat)
        ssm = alpha * ssm + beta * outer_prev + gamma * outer_now
        y[:, t] = torch.einsum("bhpn,bhrn->bhrp", ssm, C_hat) + w["D"][None, :, None, None] * x[:, t]
        prev_x, prev_B = x[:, t], B_hat
    return y, (torch.remainder(angle, 2 * math.pi), ssm, prev_x, prev_B)


def literal_mixer(w: dict, u, options, nheads: int):
    """mamba_ssm's Mamba3 forward on u (b, l, d_model), its weights `w` under their mixer names (float64)."""
    n, g, r, p = options.d_state, options.ngroups, options.rank, options.headdim
    d_inner = nheads * p
    widths = [d_inner, d_inner, g * r * n, g * r * n, nheads, nheads, nheads, options.num_rope_angles]
    z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(u @ w["in_proj.weight"].T, widths, dim=-1)
    b, length = u.shape[:2]
    x, z = x.reshape(b, length, nheads, 1, p), z.reshape(b, length, nheads, 1, p)
    if options.is_mimo:
        x, z = x * w["mimo_x"], z * w["mimo_z"]
    B, C = B.reshape(b, length, r, g, n), C.reshape(b, length, r, g, n)
    scan_weights = {
        "dt_bias": w["dt_bias"],
        "B_norm": w["B_norm.weight"],
        "C_norm": w["C_norm.weight"],
        "B_bias": w["B_bias"],
        "C_bias": w["C_bias"],
        "D": w["D"],
    }
    y, _ = literal_scan(
        x, B, C, dd_dt, dd_A, trap, angles, scan_weights,
        mimo=options.is_mimo, activation=options.a_activation, A_floor=options.A_floor,
    )  # fmt: skip
    if options.is_outproj_norm:  # RMSNorm of each rank's head over headdim, then the gate
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * w["norm.weight"].reshape(nheads, 1, p)
    y = y * F.silu(z)
    y = (y * w["mimo_o"]).sum(3) if options.is_mimo else y[:, :, :, 0]
    return y.reshape(b, length, d_inner) @ w["out_proj.weight"].T
