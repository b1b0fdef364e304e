"""Float64: attention, the MLPs and whole hybrid LMs equal a direct computation from their own weights.

The direct computations (tests/model/hybrid_direct.py) slice in_proj by explicit offsets in mamba_ssm's
order (q, k, v), build each score matrix with its mask from positions and document ids, and rotate channel
pairs as complex numbers; the rotary convention is also checked against transformers' own functions.
Every parameter is randomised first, so no bias or norm weight is a no-op.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb as bamba_apply_rotary
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

from hybrid_direct import direct_attention, direct_mixer, direct_mlp, rotary_direct
from megamamba import MambaConfig, MambaLM
from megamamba.model.rotary import rotate
from megamamba.testing.numerics import relative_error
from test_model_oracle import packed_seq_idx, randomise

SEED = 43
TOL = 1e-10

# attn_cfg: MHA with biases; MHA with full rotary and only the out_proj bias; GQA with partial rotary and a
# softmax scale; MQA with full interleaved rotary; GQA with partial interleaved rotary on another base and
# only the qkv bias.
ATTENTION_CASES = {
    "mha_biases": {"num_heads": 3},
    "mha_full_rotary": {"num_heads": 2, "head_dim": 8, "rotary_emb_dim": 8, "qkv_proj_bias": False},
    "gqa_partial_rotary_scale": {
        "num_heads": 6,
        "num_heads_kv": 2,
        "head_dim": 10,
        "rotary_emb_dim": 4,
        "softmax_scale": 0.37,
        "qkv_proj_bias": False,
        "out_proj_bias": False,
    },
    "mqa_full_rotary_interleaved": {
        "num_heads": 3,
        "num_heads_kv": 1,
        "rotary_emb_dim": 6,
        "rotary_emb_interleaved": True,
        "out_proj_bias": False,
    },
    "gqa_partial_rotary_interleaved": {
        "num_heads": 4,
        "num_heads_kv": 2,
        "head_dim": 10,
        "rotary_emb_dim": 6,
        "rotary_emb_interleaved": True,
        "rotary_emb_base": 500.0,
        "out_proj_bias": False,
    },
}
MAMBA2 = {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8}
MAMBA1 = {"layer": "Mamba1", "d_state": 5, "dt_rank": 3}


def hybrid(attn_cfg=None, **fields):
    """d_model 18, vocab 37 (padded to 40); attention at layer 1 of 2 unless fields say otherwise."""
    base = {"d_model": 18, "n_layer": 2, "vocab_size": 37, "pad_vocab_size_multiple": 8, "ssm_cfg": MAMBA2}
    if attn_cfg is not None:
        base.update(attn_layer_idx=[1], attn_cfg={**attn_cfg, "causal": True})
    return MambaConfig(**{**base, **fields})


def documents_with_a_reused_id():
    """Row 0: ids 0, 1, 0 (three documents of 4, 3, 4: the last reuses id 0); row 1: two documents."""
    seq_idx = packed_seq_idx(2, 11)
    seq_idx[0, 4:7] = 1
    return seq_idx


def inputs(d_model, seed, batch=2, seqlen=11):
    return torch.randn(batch, seqlen, d_model, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_equals_direct_computation_from_its_weights(case, packed):
    cfg = hybrid(ATTENTION_CASES[case])
    mixer = MambaLM(cfg).backbone.layers[1].mixer.double()
    randomise(mixer, SEED)
    u = inputs(cfg.d_model, SEED)
    seq_idx = documents_with_a_reused_id() if packed else None
    with torch.no_grad():
        out = mixer(u, seq_idx=seq_idx)
        ref = direct_attention(mixer, u, cfg.attn_cfg, seq_idx)
    err = relative_error(out, ref)
    assert torch.isfinite(out).all() and err <= TOL, f"{case} packed={packed} seed {SEED}: rel err {err:.2e}"


@pytest.mark.parametrize("case", ["gqa_partial_rotary_scale", "mqa_full_rotary_interleaved"])
def test_attention_gradients_equal_the_direct_computations(case):
    """Packed documents: the gradients of the input and of every weight through the masked attention."""
    cfg = hybrid(ATTENTION_CASES[case])
    mixer = MambaLM(cfg).backbone.layers[1].mixer.double()
    randomise(mixer, SEED)
    u = inputs(cfg.d_model, SEED).requires_grad_()
    up = inputs(cfg.d_model, SEED + 1)
    seq_idx = documents_with_a_reused_id()
    out_grads = torch.autograd.grad((mixer(u, seq_idx=seq_idx) * up).sum(), [u, *mixer.parameters()])
    ref_grads = torch.autograd.grad(
        (direct_attention(mixer, u, cfg.attn_cfg, seq_idx) * up).sum(), [u, *mixer.parameters()]
    )
    names = ["input", *(n for n, _ in mixer.named_parameters())]
    errs = {n: relative_error(g, r) for n, g, r in zip(names, out_grads, ref_grads)}
    worst = max(errs, key=errs.get)
    assert all(torch.isfinite(g).all() for g in out_grads), f"{case} seed {SEED}: a gradient is not finite"
    assert errs[worst] <= TOL, f"{case} seed {SEED}: gradient of {worst} off by {errs[worst]:.2e}"


@pytest.mark.parametrize("activation", ["gated_silu", "squared_relu"])
def test_mlp_equals_direct_computation_from_its_weights(activation):
    cfg = hybrid(hybrid_layer_pattern="M-", d_intermediate=23, mlp_activation=activation)
    mixer = MambaLM(cfg).backbone.layers[1].mixer.double()
    randomise(mixer, SEED)
    assert mixer.fc1.weight.shape == ((46 if activation == "gated_silu" else 23), 18)
    u = inputs(cfg.d_model, SEED)
    with torch.no_grad():
        out, ref = mixer(u), direct_mlp(mixer, u, activation)
    err = relative_error(out, ref)
    assert torch.isfinite(out).all() and err <= TOL, f"{activation} seed {SEED}: rel err {err:.2e}"


def qk(seed, heads=3, head_dim=10, seqlen=9):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, seqlen, heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("dim,base", [(4, 10000.0), (10, 500.0)], ids=["partial", "full"])
def test_rotary_equals_transformers_bamba_rotate_half_on_the_first_channels(dim, base):
    """Bamba's apply_rotary_pos_emb rotates as many channels as cos has (its partial_rotary_factor)."""
    q, k = qk(SEED)
    positions = torch.arange(q.shape[1])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # BambaRotaryEmbedding's
    freqs = positions[:, None].double() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # (1, seqlen, dim), as its forward returns
    ref_q, ref_k = bamba_apply_rotary(q, k, emb.cos(), emb.sin(), unsqueeze_dim=2)
    out_q, out_k = rotate(q, positions, dim, base, False), rotate(k, positions, dim, base, False)
    err = max(relative_error(out_q, ref_q), relative_error(out_k, ref_k))
    assert err <= 1e-14, f"rotary dim {dim} base {base} seed {SEED}: rel err {err:.2e}"
    assert relative_error(rotary_direct(q, range(q.shape[1]), dim, base, False), ref_q) <= 1e-14


def test_interleaved_rotary_equals_transformers_gptj_rotate_every_two():
    """GPT-J rotates channel pairs (2i, 2i + 1) of its first rotary_dim channels, base 10000."""
    dim = 6
    q, _ = qk(SEED + 1)
    positions = torch.arange(q.shape[1])
    sincos = create_sinusoidal_positions(q.shape[1], dim).double()[positions][None]
    sin, cos = sincos.chunk(2, dim=-1)
    ref = torch.cat([gptj_apply_rotary(q[..., :dim], sin, cos), q[..., dim:]], dim=-1)
    err = relative_error(rotate(q, positions, dim, 10000.0, True), ref)
    assert err <= 1e-6, f"seed {SEED + 1}: rel err {err:.2e}"  # GPT-J's table is float32
    assert relative_error(rotary_direct(q, range(q.shape[1]), dim, 10000.0, True), ref) <= 1e-6


def direct_lm(model, cfg, ids, seq_idx=None):
    """Embedding, then per block s + mixer(norm(s)) [+ mlp(norm2(s))], final norm and head, directly."""

    def norm(module, h):
        if cfg.rms_norm:
            return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * module.weight
        return F.layer_norm(h, h.shape[-1:], module.weight, module.bias, eps=1e-5)

    h = model.backbone.embedding.weight[ids]
    for kind, block in zip(cfg.block_kinds, model.backbone.layers):
        h = h + direct_mixer(block, kind, norm(block.norm, h), cfg, seq_idx)
        if cfg.mlp_inside_blocks:
            h = h + direct_mlp(block.mlp, norm(block.norm2, h), cfg.mlp_activation)
    return norm(model.backbone.norm_f, h) @ model.lm_head.weight.T


HYBRID_LMS = {
    # mamba_ssm's fields: attention at 1 (GQA, partial rotary), a gated MLP inside every block
    "attn_layer_idx_d_intermediate": hybrid(
        ATTENTION_CASES["gqa_partial_rotary_scale"], n_layer=3, attn_layer_idx=[1], d_intermediate=20
    ),
    # a pattern with all three kinds, squared-ReLU MLPs, LayerNorm, Mamba-1, untied head
    "pattern_squared_relu": hybrid(
        ATTENTION_CASES["mqa_full_rotary_interleaved"],
        n_layer=4,
        attn_layer_idx=[],
        hybrid_layer_pattern="M*-M",
        d_intermediate=21,
        mlp_activation="squared_relu",
        rms_norm=False,
        residual_in_fp32=False,
        tie_embeddings=False,
        ssm_cfg=MAMBA1,
    ),
}


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("name", list(HYBRID_LMS))
def test_hybrid_lm_equals_the_direct_computation(name, packed):
    cfg = HYBRID_LMS[name]
    model = MambaLM(cfg).double()
    randomise(model, SEED)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(SEED))
    seq_idx = packed_seq_idx(2, 11) if packed else None
    with torch.no_grad():
        out, ref = model(ids, seq_idx=seq_idx), direct_lm(model, cfg, ids, seq_idx)
    assert out.shape == (2, 11, 40)
    err = relative_error(out, ref)
    assert torch.isfinite(out).all() and err <= TOL, f"{name} packed={packed} seed {SEED}: rel err {err:.2e}"
