"""The recurrent form (step, prefill) computes the same logits as the parallel forward."""
import pytest
import torch

from megamamba import MambaLM

LAYERS = ["Mamba1", "Mamba2"]
SEQLEN = 21  # not a multiple of the tiny Mamba-2 chunk_size (8)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def model_and_ids(tiny_config, layer, seed, batch=3, ssm=None):
    torch.manual_seed(seed)
    cfg = tiny_config(layer, ssm)
    model = MambaLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, SEQLEN))
    return model, ids


@pytest.mark.parametrize("layer,ssm", [("Mamba1", None), ("Mamba2", None),
                                       ("Mamba2", {"rmsnorm": False, "D_has_hdim": True}),
                                       ("Mamba2", {"dt_limit": [0.01, 0.05], "norm_before_gate": True})])
def test_token_by_token_step_equals_parallel_forward(tiny_config, layer, ssm):
    seed = 11
    model, ids = model_and_ids(tiny_config, layer, seed, ssm=ssm)
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        stepped = torch.stack([model.step(ids[:, t], cache) for t in range(SEQLEN)], dim=1)
    assert torch.isfinite(stepped).all()
    err = rel_err(stepped, parallel)
    assert err <= 1e-5, f"{layer} {ssm} seed {seed}: step vs forward rel err {err:.2e}"


@pytest.mark.parametrize("layer", LAYERS)
def test_prefill_then_step_continues_the_sequence(tiny_config, layer):
    seed, prompt = 12, 13
    model, ids = model_and_ids(tiny_config, layer, seed)
    with torch.no_grad():
        parallel = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, SEQLEN)], dim=1)
    out = torch.cat([prefill, rest], dim=1)
    assert torch.isfinite(out).all()
    err = rel_err(out, parallel)
    assert err <= 1e-5, f"{layer} seed {seed}: prefill+step vs forward rel err {err:.2e}"


@pytest.mark.parametrize("layer", LAYERS)
def test_prefill_shorter_than_the_conv_width(tiny_config, layer):
    seed = 13
    model, ids = model_and_ids(tiny_config, layer, seed, batch=2)
    with torch.no_grad():
        parallel = model(ids[:, :6])
        cache = model.allocate_inference_cache(2)
        prefill = model(ids[:, :2], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(2, 6)], dim=1)
    err = rel_err(torch.cat([prefill, rest], dim=1), parallel)
    assert err <= 1e-5, f"{layer} seed {seed}: rel err {err:.2e}"


def test_cache_with_seq_idx_is_refused(tiny_config):
    model, ids = model_and_ids(tiny_config, "Mamba1", 0)
    seq_idx = torch.zeros(ids.shape, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_idx"):
        model(ids, seq_idx=seq_idx, inference_cache=model.allocate_inference_cache(ids.shape[0]))
