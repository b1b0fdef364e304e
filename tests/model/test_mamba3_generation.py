"""Mamba-3's recurrent step (angle, ssm state, previous token's values and B̂) computes the full forward's
logits, alone or after a prefill, and greedy generation through it picks what full forwards pick."""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.generate import generate_ids
from megamamba.testing.numerics import relative_error

SEQLEN = 11  # not a multiple of chunk_size
MIXERS = {
    "siso": {"d_state": 8, "headdim": 6, "ngroups": 2, "chunk_size": 4},
    "mimo": {
        "d_state": 8,
        "headdim": 6,
        "is_mimo": True,
        "mimo_rank": 2,
        "is_outproj_norm": True,
        "rope_fraction": 1.0,
        "chunk_size": 4,
        "a_activation": "softplus",
    },
}


def model_and_ids(mixer: str, seed: int):
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=18, n_layer=2, vocab_size=37, ssm_cfg={"layer": "Mamba3", **MIXERS[mixer]})
    return MambaLM(cfg).eval(), torch.randint(0, 37, (2, SEQLEN))


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_token_by_token_step_equals_full_forward(mixer):
    seed = 41
    model, ids = model_and_ids(mixer, seed)
    with torch.no_grad():
        full = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        stepped = torch.stack([model.step(ids[:, t], cache) for t in range(SEQLEN)], dim=1)
    err = relative_error(stepped, full)
    assert err <= 1e-5, f"{mixer} seed {seed}: step vs forward rel err {err:.2e}"


def test_prefill_then_step_continues_the_sequence():
    seed, prompt = 42, 6
    model, ids = model_and_ids("mimo", seed)
    with torch.no_grad():
        full = model(ids)
        cache = model.allocate_inference_cache(ids.shape[0])
        prefill = model(ids[:, :prompt], inference_cache=cache)
        rest = torch.stack([model.step(ids[:, t], cache) for t in range(prompt, SEQLEN)], dim=1)
    err = relative_error(torch.cat([prefill, rest], dim=1), full)
    assert err <= 1e-5, f"seed {seed}: prefill + step vs forward rel err {err:.2e}"


def test_greedy_generation_equals_argmax_of_full_forwards():
    model, ids = model_and_ids("siso", 43)
    prompt = ids[:, :4]
    with torch.no_grad():
        generated = generate_ids(model, prompt, max_new_tokens=6, greedy=True)
        sequence = prompt
        for _ in range(6):
            sequence = torch.cat([sequence, model(sequence)[:, -1, :37].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, sequence[:, 4:])
