"""State-dict keys and shapes are mamba_ssm's MambaLMHeadModel's, so its checkpoints load with strict=True.

The expected tables are written out from mamba_ssm's module definitions (mixer_seq_simple.py,
block.py, mamba_simple.py `Mamba`, mamba2.py `Mamba2`), not derived from our modules.
"""

import pytest
import torch

from megamamba import MambaLM


def mamba_ssm_mixer_shapes(cfg) -> dict:
    """The mixer parameters mamba_ssm's constructors register, for cfg's options."""
    o, D = cfg.ssm_cfg, cfg.d_model
    di = o.get("expand", 2) * D
    W = o.get("d_conv", 4)
    bias, conv_bias = o.get("bias", False), o.get("conv_bias", True)
    if o.get("layer", "Mamba1") == "Mamba1":
        N = o.get("d_state", 16)
        R = o["dt_rank"]
        shapes = {
            "A_log": (di, N),
            "D": (di,),
            "in_proj.weight": (2 * di, D),
            "conv1d.weight": (di, 1, W),
            "x_proj.weight": (R + 2 * N, di),
            "dt_proj.weight": (di, R),
            "dt_proj.bias": (di,),
            "out_proj.weight": (D, di),
        }
        conv_dim = di
    else:
        N, P, G = o.get("d_state", 128), o.get("headdim", 64), o.get("ngroups", 1)
        H = di // P
        conv_dim = di + 2 * G * N
        shapes = {
            "dt_bias": (H,),
            "A_log": (H,),
            "D": (di,) if o.get("D_has_hdim", False) else (H,),
            "in_proj.weight": (2 * di + 2 * G * N + H, D),
            "conv1d.weight": (conv_dim, 1, W),
            "out_proj.weight": (D, di),
        }
        if o.get("rmsnorm", True):
            shapes["norm.weight"] = (di,)
    if bias:
        shapes["in_proj.bias"] = (shapes["in_proj.weight"][0],)
        shapes["out_proj.bias"] = (D,)
    if conv_bias:
        shapes["conv1d.bias"] = (conv_dim,)
    return shapes


def mamba_ssm_lm_shapes(cfg) -> dict:
    V = -(-cfg.vocab_size // cfg.pad_vocab_size_multiple) * cfg.pad_vocab_size_multiple
    D = cfg.d_model
    norm = {"weight": (D,)} if cfg.rms_norm else {"weight": (D,), "bias": (D,)}
    shapes = {"backbone.embedding.weight": (V, D), "lm_head.weight": (V, D)}
    for i in range(cfg.n_layer):
        shapes.update({f"backbone.layers.{i}.norm.{k}": s for k, s in norm.items()})
        shapes.update({f"backbone.layers.{i}.mixer.{k}": s for k, s in mamba_ssm_mixer_shapes(cfg).items()})
    shapes.update({f"backbone.norm_f.{k}": s for k, s in norm.items()})
    return shapes


VARIANTS = [
    ("Mamba1", {}, {}),
    ("Mamba1", {"bias": True, "conv_bias": False, "d_conv": 3, "expand": 3}, {"rms_norm": False}),
    ("Mamba2", {}, {}),
    ("Mamba2", {"D_has_hdim": True, "bias": True}, {"tie_embeddings": False}),
    ("Mamba2", {"rmsnorm": False, "conv_bias": False}, {"rms_norm": False}),
]


@pytest.mark.parametrize("layer,ssm,fields", VARIANTS)
def test_state_dict_keys_and_shapes_are_mamba_ssms(tiny_config, layer, ssm, fields):
    cfg = tiny_config(layer, ssm, **fields)
    got = {k: tuple(v.shape) for k, v in MambaLM(cfg).state_dict().items()}
    assert got == mamba_ssm_lm_shapes(cfg)


@pytest.mark.parametrize("layer,ssm,fields", VARIANTS)
def test_a_mamba_ssm_shaped_checkpoint_loads_strictly(tiny_config, layer, ssm, fields):
    cfg = tiny_config(layer, ssm, **fields)
    g = torch.Generator().manual_seed(3)
    checkpoint = {k: torch.randn(s, generator=g) for k, s in mamba_ssm_lm_shapes(cfg).items()}
    if cfg.tie_embeddings:
        checkpoint["lm_head.weight"] = checkpoint["backbone.embedding.weight"]
    model = MambaLM(cfg)
    model.load_state_dict(checkpoint, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, checkpoint[k]), k
    assert torch.isfinite(model(torch.randint(0, cfg.vocab_size, (1, 5)))).all()
