"""Float64: each mixer, and the whole LM, equal a direct computation from their own weights.

The direct computation slices the fused projections by explicit offsets in mamba_ssm's order
(Mamba-1 in_proj: x, z; x_proj: dt, B, C. Mamba-2 in_proj: z, x, B, C, dt) and runs the
per-timestep oracle ops of tests/naive_ops.py, so a wrong split order, a transposed layout or
a missing term shows. Every parameter is randomised first (biases, norm weights, D) so none
is a no-op.
"""

import pytest
import torch

import naive_ops
from megamamba import MambaLM
from megamamba.testing.numerics import relative_error

SEED = 41


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if name != "A_log" else 1.0))


def linear(x, lin):
    return x @ lin.weight.T + (lin.bias if lin.bias is not None else 0)


def direct_mamba1(m, u, seq_idx):
    di, R, N = m.d_inner, m.dt_rank, m.d_state
    xz = linear(u, m.in_proj)
    x, z = xz[..., :di], xz[..., di:]
    x = naive_ops.causal_conv1d(
        x.transpose(1, 2), m.conv1d.weight[:, 0], m.conv1d.bias, seq_idx=seq_idx, activation="silu"
    )  # (b, di, l)
    x_dbl = x.transpose(1, 2) @ m.x_proj.weight.T
    dt, B, C = x_dbl[..., :R], x_dbl[..., R : R + N], x_dbl[..., R + N :]
    delta = dt @ m.dt_proj.weight.T
    y = naive_ops.selective_scan(
        x,
        delta.transpose(1, 2),
        -torch.exp(m.A_log),
        B.transpose(1, 2),
        C.transpose(1, 2),
        D=m.D,
        z=z.transpose(1, 2),
        delta_bias=m.dt_proj.bias,
        delta_softplus=True,
        seq_idx=seq_idx,
    )
    return linear(y.transpose(1, 2), m.out_proj)


def direct_mamba2(m, u, seq_idx, options):
    di, G, N, H, P = m.d_inner, m.ngroups, m.d_state, m.nheads, m.headdim
    b, L, _ = u.shape
    p = linear(u, m.in_proj)
    z, x = p[..., :di], p[..., di : 2 * di]
    B, C = p[..., 2 * di : 2 * di + G * N], p[..., 2 * di + G * N : 2 * di + 2 * G * N]
    dt = p[..., 2 * di + 2 * G * N :]
    assert dt.shape[-1] == H
    xBC = torch.cat([x, B, C], dim=-1).transpose(1, 2)
    xBC = naive_ops.causal_conv1d(
        xBC, m.conv1d.weight[:, 0], m.conv1d.bias, seq_idx=seq_idx, activation="silu"
    ).transpose(1, 2)
    x, B, C = xBC[..., :di], xBC[..., di : di + G * N], xBC[..., di + G * N :]
    D = m.D.reshape(H, P) if options.get("D_has_hdim") else m.D
    gate_in_scan = not options.get("rmsnorm", True)
    y = naive_ops.ssd_chunk_scan(
        x.reshape(b, L, H, P),
        dt,
        -torch.exp(m.A_log),
        B.reshape(b, L, G, N),
        C.reshape(b, L, G, N),
        8,
        D=D,
        z=z.reshape(b, L, H, P) if gate_in_scan else None,
        dt_bias=m.dt_bias,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=tuple(options.get("dt_limit", (0.0, float("inf")))),
    )
    y = y.reshape(b, L, di)
    if not gate_in_scan:
        y = naive_ops.rmsnorm_gated(
            y, m.norm.weight, z=z, eps=1e-5, group_size=di // G, norm_before_gate=options.get("norm_before_gate", False)
        )
    return linear(y, m.out_proj)


def packed_seq_idx(batch, seqlen):
    """Row 0 one document, row 1 two documents (boundary at 5)."""
    seq_idx = torch.zeros(batch, seqlen, dtype=torch.int32)
    seq_idx[1, 5:] = 1
    return seq_idx


MIXER_CASES = [
    ("Mamba1", {"bias": True}),
    ("Mamba2", {"bias": True}),
    ("Mamba2", {"norm_before_gate": True, "D_has_hdim": True}),
    ("Mamba2", {"rmsnorm": False, "dt_limit": [0.05, 2.0]}),
]


@pytest.mark.parametrize("layer,options", MIXER_CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_mixer_forward_equals_direct_computation_from_its_weights(tiny_config, layer, options, packed):
    cfg = tiny_config(layer, options)
    mixer = MambaLM(cfg).backbone.layers[0].mixer.double()
    randomise(mixer, SEED)
    u = torch.randn(2, 11, cfg.d_model, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    seq_idx = packed_seq_idx(2, 11) if packed else None
    with torch.no_grad():
        out = mixer(u, seq_idx=seq_idx)
        ref = direct_mamba1(mixer, u, seq_idx) if layer == "Mamba1" else direct_mamba2(mixer, u, seq_idx, options)
    assert torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= 1e-10, f"{layer} {options} packed={packed} seed {SEED}: rel err {err:.2e}"


@pytest.mark.parametrize("layer,rms_norm,residual_in_fp32", [("Mamba1", True, True), ("Mamba2", False, False)])
def test_lm_forward_equals_prenorm_residual_stack(tiny_config, layer, rms_norm, residual_in_fp32):
    cfg = tiny_config(layer, rms_norm=rms_norm, residual_in_fp32=residual_in_fp32, n_layer=3)
    model = MambaLM(cfg).double()
    randomise(model, SEED)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(SEED))

    def norm(module, h):
        if rms_norm:
            return naive_ops.rmsnorm_gated(h, module.weight, eps=1e-5)
        return torch.nn.functional.layer_norm(h, h.shape[-1:], module.weight, module.bias, eps=1e-5)

    with torch.no_grad():
        h = model.backbone.embedding.weight[ids]
        for layer_module in model.backbone.layers:  # x <- x + mixer(norm(x))
            h = h + layer_module.mixer(norm(layer_module.norm, h))
        ref = norm(model.backbone.norm_f, h) @ model.lm_head.weight.T
        out = model(ids)
    assert out.shape == (2, 9, 40) and torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= 1e-10, f"{layer} seed {SEED}: rel err {err:.2e}"
