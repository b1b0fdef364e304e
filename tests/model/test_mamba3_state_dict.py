"""A mamba_ssm 2.3.2.post1 `Mamba3` state dict (every tensor random: norms, biases, MIMO projections) loads
strict into our MambaLM, whose fp32 logits equal Mamba-3's equations evaluated literally in float64
(tests/mamba3_literal.py), SISO and MIMO."""

import pytest
import torch

import mamba_ssm_source
from mamba3_literal import literal_mixer
from megamamba import MambaConfig, MambaLM

TOL = 1e-5
VOCAB, D_MODEL, BATCH, SEQLEN = 37, 18, 2, 11
MIXERS = {
    "siso": {"d_state": 8, "headdim": 6, "ngroups": 2, "rope_fraction": 1.0, "chunk_size": 4},
    "mimo": {
        "d_state": 8,
        "headdim": 6,
        "ngroups": 2,
        "is_mimo": True,
        "mimo_rank": 2,
        "is_outproj_norm": True,
        "chunk_size": 4,
        "a_activation": "softplus",
    },
}


def config(mixer: str) -> MambaConfig:
    return MambaConfig(
        d_model=D_MODEL, n_layer=2, vocab_size=VOCAB, ssm_cfg={"layer": "Mamba3", **MIXERS[mixer]}, tie_embeddings=False
    )


def their_mixers(cfg: MambaConfig, gen: torch.Generator) -> dict:
    """mamba_ssm's Mamba3 modules of each layer, every tensor redrawn, as an LM state dict's mixer entries."""
    with mamba_ssm_source.loaded() as (theirs, why):
        if theirs is None:
            pytest.skip(why)
        from mamba_ssm.modules import mamba3

        mamba3.mamba3_mimo_combined = object()  # its constructor only asserts the TileLang kernel imported
        options = {k: v for k, v in cfg.ssm_cfg.items() if k not in ("layer", "a_activation")}
        entries = {}
        for i in range(cfg.n_layer):
            mixer = mamba3.Mamba3(cfg.d_model, layer_idx=i, **options)
            for name, tensor in mixer.state_dict().items():
                key = f"backbone.layers.{i}.mixer.{name}"
                entries[key] = drawn(key, tensor, gen)
        return entries


def drawn(name: str, tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random value of a parameter's shape and dtype: norm weights around 1, matrices scaled by their fan-in,
    MIMO projections by the rank, the rest standard normal."""
    noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float64)
    last = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if "norm" in last:
        noise = 1 + noise / 3
    elif last in ("in_proj", "out_proj", "embedding", "lm_head"):
        noise = noise / tensor.shape[-1] ** 0.5
    elif last.startswith("mimo_"):
        noise = noise / tensor.shape[1]
    return noise.to(tensor.dtype)


def literal_logits(sd: dict, cfg: MambaConfig, ids: torch.Tensor) -> torch.Tensor:
    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    w = {k: v.double() for k, v in sd.items()}
    h = w["backbone.embedding.weight"][ids]
    for i in range(cfg.n_layer):
        prefix = f"backbone.layers.{i}.mixer."
        mixer = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
        normed = rms(h, w[f"backbone.layers.{i}.norm.weight"])
        h = h + literal_mixer(mixer, normed, cfg.mixer_options, cfg.nheads)
    return rms(h, w["backbone.norm_f.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_mamba_ssm_mamba3_state_dict_loads_strict_and_gives_literal_logits(mixer):
    seed = 11 if mixer == "siso" else 12
    gen = torch.Generator().manual_seed(seed)
    cfg = config(mixer)
    ours = MambaLM(cfg)
    theirs = their_mixers(cfg, gen)
    state = {name: drawn(name, t, gen) for name, t in ours.state_dict().items()}
    state.update(theirs)
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQLEN), generator=gen)
    with torch.no_grad():
        logits = ours(ids)[..., :VOCAB].double()
    want = literal_logits(state, cfg, ids)[..., :VOCAB]
    err = ((logits - want).norm() / want.norm()).item()
    assert err <= TOL, f"seed {seed}: {mixer} logits rel err {err:.2e} (nan fails too)"
