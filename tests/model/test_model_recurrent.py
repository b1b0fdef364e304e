"""The recurrent form (step, prefill) computes the same logits as the parallel forward, for pure Mamba models
and hybrids (attention layers keep a KV cache; MLP layers have no state)."""

import pytest
import torch

from megamamba import MambaLM
from megamamba.testing.numerics import relative_error

LAYERS = ["Mamba1", "Mamba2"]
SEQLEN = 21  # not a multiple of the tiny Mamba-2 chunk_size (8)
ATTN = {"num_heads": 6, "num_heads_kv": 2, "head_dim": 4, "rotary_emb_dim": 2, "causal": True}
HYBRIDS = {  # mamba_ssm's fields (GQA attention, a gated MLP inside every block); a pattern with every kind (MQA)
    "attn_layer_idx": {"n_layer": 3, "attn_layer_idx": [1], "attn_cfg": ATTN, "d_intermediate": 20},
    "pattern": {
        "n_layer": 4,
        "hybrid_layer_pattern": "M*-*",
        "d_intermediate": 20,
        "mlp_activation": "squared_relu",
        "attn_cfg": {**ATTN, "num_heads_kv": 1, "rotary_emb_interleaved": True},
    },
}


def model_and_ids(tiny_config, layer, seed, batch=3, ssm=None, fields=None, seqlen=SEQLEN):
    torch.manual_seed(seed)
    cfg = tiny_config(layer, ssm, **(fields or {}))
    model = MambaLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen))
    return model, ids


@pytest.mark.parametrize(
    "layer,ssm,hybrid",
    [
        ("Mamba1", None, None),
        ("Mamba2", None, None),
        ("Mamba2", {"rmsnorm": False, "D_has_hdim": True}, None),
        ("Mamba2", {"dt_limit": [0.01, 0.05], "norm_before_gate": True}, None),
        ("Mamba2", None, "attn_layer_idx"),
        ("Mamba1", None, "pattern"),
    ],
)
def test_token_by_token_step_equals_parallel_forward(tiny_config, layer, ssm, hybrid):
    seed = 11
    model, ids = model_and_ids(tiny_config, layer, seed, ssm=ssm, fields=HYBRIDS.get(hybrid))
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        stepped = torch.stack([model.step(ids[:, t], cache) for t in range(SEQLEN)], dim=1)
    assert torch.isfinite(stepped).all()
    err = relative_error(stepped, parallel)
    assert err <= 1e-5, f"{layer} {ssm} {hybrid} seed {seed}: step vs forward rel err {err:.2e}"


@pytest.mark.parametrize(
    "layer,hybrid", [("Mamba1", None), ("Mamba2", None), ("Mamba2", "attn_layer_idx"), ("Mamba1", "pattern")]
)
def test_prefill_then_step_continues_the_sequence(tiny_config, layer, hybrid):
    seed, prompt = 12, 13
    model, ids = model_and_ids(tiny_config, layer, seed, fields=HYBRIDS.get(hybrid))
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, SEQLEN)], dim=1)
    out = torch.cat([prefill, rest], dim=1)
    assert torch.isfinite(out).all()
    err = relative_error(out, parallel)
    assert err <= 1e-5, f"{layer} {hybrid} seed {seed}: prefill+step vs forward rel err {err:.2e}"


def test_hybrid_prefill_then_step_under_bf16_autocast(tiny_config):
    """The KV cache holds float32 (the weights' dtype) while autocast computes keys in bf16: each step
    attends in the queries' dtype, as the forward does."""
    seed, prompt = 15, 13
    model, ids = model_and_ids(tiny_config, "Mamba2", seed, fields=HYBRIDS["attn_layer_idx"])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, SEQLEN)], dim=1)
    err = relative_error(torch.cat([prefill, rest], dim=1), parallel)
    assert err <= 2e-2, f"seed {seed}: prefill+step vs forward under bf16 autocast rel err {err:.2e}"


@pytest.mark.parametrize("prompt", [60, 70], ids=["grows_in_a_step", "grows_in_the_prefill"])
def test_kv_cache_grows_past_its_first_capacity(tiny_config, prompt):
    """The cache holds 64 positions at first: steps from 60, or a prefill of 70, go past it."""
    seed, seqlen = 14, 74
    model, ids = model_and_ids(tiny_config, "Mamba2", seed, batch=2, fields=HYBRIDS["attn_layer_idx"], seqlen=seqlen)
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(2)
        assert cache[1].keys.shape[1] == 64
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, seqlen)], dim=1)
    assert cache[1].length == seqlen and cache[1].keys.shape[1] >= seqlen
    err = relative_error(torch.cat([prefill, rest], dim=1), parallel)
    assert err <= 1e-5, f"prompt {prompt} seed {seed}: prefill+step vs forward rel err {err:.2e}"


@pytest.mark.parametrize("layer,hybrid", [("Mamba2", None), ("Mamba2", "attn_layer_idx"), ("Mamba1", "pattern")])
def test_a_prefill_into_a_used_cache_starts_the_sequence_over(tiny_config, layer, hybrid):
    """Mamba layers overwrite their states; attention layers must drop the keys of the earlier sequence."""
    seed, prompt = 16, 9
    model, ids = model_and_ids(tiny_config, layer, seed, fields=HYBRIDS.get(hybrid))
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        model(ids.flip(1), inference_cache=cache)
        model.step(ids[:, 0], cache)
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, SEQLEN)], dim=1)
    err = relative_error(torch.cat([prefill, rest], dim=1), parallel)
    assert err <= 1e-5, f"{layer} {hybrid} seed {seed}: prefill+step after an earlier sequence rel err {err:.2e}"


@pytest.mark.parametrize("layer", LAYERS)
def test_prefill_shorter_than_the_conv_width(tiny_config, layer):
    seed = 13
    model, ids = model_and_ids(tiny_config, layer, seed, batch=2)
    with torch.no_grad():
        parallel = model(ids[:, :6])
        cache = model.allocate_inference_cache(2)
        prefill = model(ids[:, :2], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(2, 6)], dim=1)
    err = relative_error(torch.cat([prefill, rest], dim=1), parallel)
    assert err <= 1e-5, f"{layer} seed {seed}: rel err {err:.2e}"


def test_cache_with_seq_idx_is_refused(tiny_config):
    model, ids = model_and_ids(tiny_config, "Mamba1", 0)
    seq_idx = torch.zeros(ids.shape, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_idx"):
        model(ids, seq_idx=seq_idx, inference_cache=model.allocate_inference_cache(ids.shape[0]))
