"""Direct float64 computations of the hybrid layers from their own weights (importable as `hybrid_direct`).

Written independently of the model's code paths: attention as an explicit score matrix per head with its
mask built from positions and document ids in loops' terms, rotary as a complex rotation of channel pairs,
the MLPs from their formulas. The Mamba mixers come from tests/model/test_model_oracle.py.
"""

import math

import torch

from test_model_oracle import direct_mamba1, direct_mamba2, linear


def rotary_direct(x, positions, dim, base, interleaved):
    """x (batch, seqlen, heads, head_dim): channel pairs of [0, dim) as complex numbers times e^(i t theta_j),
    theta_j = base^(-2j/dim); pairs (j, j + dim/2), or (2j, 2j + 1) when interleaved."""
    if dim == 0:
        return x
    half = dim // 2
    rot = x[..., :dim]
    if interleaved:
        re, im = rot[..., 0::2], rot[..., 1::2]
    else:
        re, im = rot[..., :half], rot[..., half:]
    theta = torch.tensor([base ** (-2 * j / dim) for j in range(half)], dtype=torch.float64)
    phase = torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64),
        torch.tensor(positions, dtype=torch.float64)[:, None] * theta,
    )[:, None]
    turned = torch.complex(re, im) * phase
    if interleaved:
        rotated = torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([turned.real, turned.imag], dim=-1)
    return torch.cat([rotated, x[..., dim:]], dim=-1)


def direct_attention(m, u, options, seq_idx=None):
    """mamba_ssm's MHA from m's weights: in_proj rows [q, k, v], query head h reads key head h // (H / H_kv),
    key j visible to query i when j <= i and (with seq_idx) both lie in the same document: the ids from j to
    i are all equal (an id reused after another starts a new document)."""
    H, Hkv = options["num_heads"], options.get("num_heads_kv") or options["num_heads"]
    D = options.get("head_dim") or u.shape[-1] // H
    b, L, _ = u.shape
    p = linear(u, m.in_proj)
    q = p[..., : H * D].reshape(b, L, H, D)
    k = p[..., H * D : (H + Hkv) * D].reshape(b, L, Hkv, D)
    v = p[..., (H + Hkv) * D :].reshape(b, L, Hkv, D)
    assert v.shape[-2] == Hkv and p.shape[-1] == (H + 2 * Hkv) * D
    rotary = (
        options.get("rotary_emb_dim", 0),
        options.get("rotary_emb_base", 10000.0),
        options.get("rotary_emb_interleaved", False),
    )
    q, k = rotary_direct(q, range(L), *rotary), rotary_direct(k, range(L), *rotary)
    scale = options.get("softmax_scale") or 1 / math.sqrt(D)
    context = torch.zeros(b, L, H, D, dtype=u.dtype)
    for n in range(b):
        for i in range(L):
            visible = [j for j in range(i + 1) if seq_idx is None or all(seq_idx[n, j : i + 1] == seq_idx[n, i])]
            for h in range(H):
                g = h // (H // Hkv)
                scores = torch.stack([q[n, i, h] @ k[n, j, g] for j in visible]) * scale
                weights = torch.softmax(scores, dim=0)
                context[n, i, h] = sum(w * v[n, j, g] for w, j in zip(weights, visible))
    return linear(context.reshape(b, L, H * D), m.out_proj)


def direct_mlp(m, u, activation):
    """GatedMLP: fc1 rows [y, gate], y * gate * sigmoid(gate); squared ReLU: max(h, 0)^2; then fc2."""
    h = u @ m.fc1.weight.T
    if activation == "gated_silu":
        y, gate = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
        h = y * gate / (1 + torch.exp(-gate))
    else:
        h = torch.clamp(h, min=0) ** 2
    return h @ m.fc2.weight.T


def direct_mixer(block, kind, u, config, seq_idx=None):
    """The mixer of a block of `kind` ("mamba", "attention", "mlp") computed directly."""
    if kind == "attention":
        return direct_attention(block.mixer, u, config.attn_cfg, seq_idx)
    if kind == "mlp":
        return direct_mlp(block.mixer, u, config.mlp_activation)
    if config.ssm_cfg["layer"] == "Mamba1":
        return direct_mamba1(block.mixer, u, seq_idx)
    return direct_mamba2(block.mixer, u, seq_idx, config.ssm_cfg)
