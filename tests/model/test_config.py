"""MambaConfig: mamba_ssm's config.json form, derived sizes, and refusals that name the field."""

import json
import math

import pytest

from megamamba.config import ConfigError, MambaConfig

# mamba_ssm's MambaConfig (mamba_ssm/models/config_mamba.py): field names and defaults.
MAMBA_SSM_DEFAULTS = {
    "d_model": 2560,
    "d_intermediate": 0,
    "n_layer": 64,
    "vocab_size": 50277,
    "ssm_cfg": {},
    "attn_layer_idx": [],
    "attn_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 8,
    "tie_embeddings": True,
}


def test_fields_and_defaults_are_mamba_ssms():
    assert MambaConfig().to_dict() == MAMBA_SSM_DEFAULTS


@pytest.mark.parametrize(
    "ssm_cfg",
    [
        {},
        {"layer": "Mamba1", "d_state": 8, "dt_rank": 5, "dt_init": "constant", "use_fast_path": False},
        {
            "layer": "Mamba2",
            "d_state": 16,
            "headdim": 16,
            "ngroups": 2,
            "dt_limit": (0.0, float("inf")),
            "A_init_range": (2, 8),
            "chunk_size": 32,
            "D_has_hdim": True,
        },
    ],
)
def test_config_json_round_trip(tmp_path, ssm_cfg):
    cfg = MambaConfig(d_model=64, n_layer=3, vocab_size=257, ssm_cfg=ssm_cfg, tie_embeddings=False)
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert MambaConfig.from_json(path) == cfg
    assert set(json.loads(path.read_text())) == set(MAMBA_SSM_DEFAULTS)


def test_state_spaces_mamba2_config_json_loads():
    # config.json of state-spaces/mamba2-130m as published.
    data = {
        "d_model": 768,
        "d_intermediate": 0,
        "n_layer": 24,
        "vocab_size": 50277,
        "ssm_cfg": {"layer": "Mamba2"},
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 16,
        "tie_embeddings": True,
    }
    cfg = MambaConfig.from_dict(data)
    assert (cfg.layer, cfg.d_inner, cfg.nheads, cfg.padded_vocab_size) == ("Mamba2", 1536, 24, 50288)


def test_old_mamba1_config_json_without_newer_fields_loads():
    # config.json of state-spaces/mamba-130m: written before d_intermediate / attn_* / tie_embeddings.
    data = {
        "d_model": 768,
        "n_layer": 24,
        "vocab_size": 50277,
        "ssm_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 8,
    }
    cfg = MambaConfig.from_dict(data)
    assert (cfg.layer, cfg.d_inner, cfg.dt_rank, cfg.padded_vocab_size) == ("Mamba1", 1536, 48, 50280)
    assert cfg.tie_embeddings


def test_derived_sizes():
    cfg = MambaConfig(
        d_model=40,
        n_layer=1,
        vocab_size=100,
        pad_vocab_size_multiple=16,
        ssm_cfg={"layer": "Mamba2", "expand": 3, "headdim": 8, "ngroups": 5},
    )
    assert (cfg.d_inner, cfg.nheads, cfg.padded_vocab_size) == (120, 15, 112)
    assert cfg.mixer_options.d_state == 128  # mamba_ssm's Mamba2 default
    m1 = MambaConfig(d_model=40, n_layer=1, vocab_size=100)
    assert m1.dt_rank == math.ceil(40 / 16) and m1.mixer_options.d_state == 16


def test_sizes_of_the_other_mixer_are_refused():
    mamba1 = MambaConfig(d_model=64, n_layer=1)
    mamba2 = MambaConfig(d_model=64, n_layer=1, ssm_cfg={"layer": "Mamba2", "headdim": 16})
    with pytest.raises(AttributeError, match="nheads"):
        _ = mamba1.nheads
    with pytest.raises(AttributeError, match="dt_rank"):
        _ = mamba2.dt_rank


M2 = {"layer": "Mamba2", "headdim": 16}
ATTN = {"num_heads": 4, "causal": True}  # head_dim 16 at d_model 64

INVALID = [
    # (fields, the field the message must name, a word of the reason)
    ({"d_model": 0}, "d_model", "positive"),
    ({"n_layer": -1}, "n_layer", "positive"),
    ({"vocab_size": 2.5}, "vocab_size", "positive"),
    ({"pad_vocab_size_multiple": 0}, "pad_vocab_size_multiple", "positive"),
    ({"rms_norm": "yes"}, "rms_norm", "true or false"),
    ({"d_intermediate": -1}, "d_intermediate", ">= 0"),
    ({"mlp_activation": "gelu"}, "mlp_activation", "gated_silu"),
    ({"attn_layer_idx": [1]}, "attn_cfg", "num_heads"),
    ({"attn_layer_idx": [2], "attn_cfg": ATTN}, "attn_layer_idx", "outside"),
    ({"attn_layer_idx": [1, 1], "attn_cfg": ATTN}, "attn_layer_idx", "twice"),
    ({"attn_cfg": ATTN}, "attn_cfg", "no attention layer"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "causal": False}}, "attn_cfg.causal", "must be causal"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "num_heads_kv": 3}}, "attn_cfg.num_heads_kv", "not divisible"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "num_heads": 5}}, "attn_cfg.num_heads", "head_dim"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "rotary_emb_dim": 7}}, "attn_cfg.rotary_emb_dim", "even"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "rotary_emb_dim": 32}}, "attn_cfg.rotary_emb_dim", "head dim 16"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "mlp_dim": 64}}, "attn_cfg.mlp_dim", "not implemented"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "d_conv": 4}}, "attn_cfg.d_conv", "not implemented"),
    ({"attn_layer_idx": [1], "attn_cfg": {**ATTN, "n_heads": 4}}, "attn_cfg.n_heads", "not an option"),
    ({"hybrid_layer_pattern": "M*"}, "attn_cfg", "num_heads"),
    ({"hybrid_layer_pattern": "MX"}, "hybrid_layer_pattern", "unknown symbol"),
    ({"hybrid_layer_pattern": "ME"}, "hybrid_layer_pattern", "mixture-of-experts"),
    ({"hybrid_layer_pattern": "MMM"}, "hybrid_layer_pattern", "set n_layer to 3"),
    ({"hybrid_layer_pattern": "M||M"}, "hybrid_layer_pattern", "holds no layer"),
    ({"hybrid_layer_pattern": "M-"}, "hybrid_layer_pattern", "d_intermediate=0"),
    ({"hybrid_layer_pattern": "M*", "attn_cfg": ATTN, "d_intermediate": 64}, "d_intermediate", "no MLP layers (-)"),
    ({"hybrid_layer_pattern": "M*", "attn_cfg": ATTN, "attn_layer_idx": [1]}, "attn_layer_idx", "use one of"),
    ({"ssm_cfg": {"layer": "Mamba3", "rope_fraction": 0.75}}, "ssm_cfg.rope_fraction", "0.5 or 1.0"),
    ({"ssm_cfg": {"layer": "Mamba3", "a_activation": "exp"}}, "ssm_cfg.a_activation", "heavy_tail"),
    ({"ssm_cfg": {"layer": "Mamba3", "d_conv": 4}}, "ssm_cfg.d_conv", "not an option of Mamba3"),
    ({"ssm_cfg": {"layer": "S4"}}, "ssm_cfg.layer", "unknown"),
    ({"ssm_cfg": {"d_stat": 16}}, "ssm_cfg.d_stat", "not an option"),
    ({"ssm_cfg": {"headdim": 16}}, "ssm_cfg.headdim", "not an option of Mamba1"),
    ({"ssm_cfg": {"d_state": 0}}, "ssm_cfg.d_state", "positive"),
    ({"ssm_cfg": {"d_conv": 0}}, "ssm_cfg.d_conv", "positive"),
    ({"ssm_cfg": {"expand": 0}}, "ssm_cfg.expand", "positive"),
    ({"ssm_cfg": {"expand": 1.01}}, "ssm_cfg.expand", "not an integer"),
    ({"ssm_cfg": {"dt_rank": 0}}, "ssm_cfg.dt_rank", "positive"),
    ({"ssm_cfg": {"dt_init": "normal"}}, "ssm_cfg.dt_init", "random"),
    ({"ssm_cfg": {"dt_min": 0.2}}, "ssm_cfg.dt_min", "exceeds"),
    ({"ssm_cfg": {"dt_min": 0.0}}, "ssm_cfg.dt_min", "positive"),
    ({"ssm_cfg": {"dt_init_floor": -1e-4}}, "ssm_cfg.dt_init_floor", ">= 0"),
    ({"ssm_cfg": {"dt_scale": 0}}, "ssm_cfg.dt_scale", "positive"),
    ({"ssm_cfg": {"bias": 1}}, "ssm_cfg.bias", "true or false"),
    ({"ssm_cfg": {**M2, "headdim": 48}}, "ssm_cfg.headdim", "not divisible"),
    ({"ssm_cfg": {**M2, "ngroups": 3}}, "ssm_cfg.ngroups", "not divisible"),
    ({"ssm_cfg": {**M2, "d_ssm": 64}}, "ssm_cfg.d_ssm", "not implemented"),
    ({"ssm_cfg": {**M2, "A_init_range": [0, 16]}}, "ssm_cfg.A_init_range", "0 < low"),
    ({"ssm_cfg": {**M2, "A_init_range": [1, "x"]}}, "ssm_cfg.A_init_range", "pair"),
    ({"ssm_cfg": {**M2, "dt_limit": [0.1, 0.01]}}, "ssm_cfg.dt_limit", "low < high"),
    ({"ssm_cfg": {**M2, "chunk_size": 0}}, "ssm_cfg.chunk_size", "positive"),
    ({"ssm_cfg": {**M2, "conv_init": -1.0}}, "ssm_cfg.conv_init", "positive"),
    ({"ssm_cfg": {**M2, "dt_rank": 4}}, "ssm_cfg.dt_rank", "not an option of Mamba2"),
]


@pytest.mark.parametrize("fields,name,reason", INVALID, ids=[f"{c[1]}-{i}" for i, c in enumerate(INVALID)])
def test_invalid_or_unsupported_config_is_refused_naming_the_field(fields, name, reason):
    base = {"d_model": 64, "n_layer": 2, "vocab_size": 257}
    with pytest.raises(ConfigError) as err:
        MambaConfig(**{**base, **fields})
    assert f"{name}=" in str(err.value) and reason in str(err.value)


def test_mamba_ssm_hybrid_fields_place_attention_and_an_mlp_in_every_block():
    cfg = MambaConfig(d_model=64, n_layer=3, attn_layer_idx=[1], attn_cfg=ATTN, d_intermediate=100)
    assert cfg.block_kinds == ["mamba", "attention", "mamba"]
    assert cfg.mlp_inside_blocks and cfg.mlp_width == 128  # GatedMLP rounds up to a multiple of 128
    assert cfg.to_dict() == {
        **MAMBA_SSM_DEFAULTS,
        "d_model": 64,
        "n_layer": 3,
        "attn_layer_idx": [1],
        "attn_cfg": ATTN,
        "d_intermediate": 100,
    }


def test_a_pattern_names_each_layer_and_its_stage_boundaries():
    cfg = MambaConfig(
        d_model=64,
        n_layer=5,
        hybrid_layer_pattern="M-*|M-",
        attn_cfg=ATTN,
        d_intermediate=100,
        mlp_activation="squared_relu",
    )
    assert cfg.block_kinds == ["mamba", "mlp", "attention", "mamba", "mlp"]
    assert cfg.pattern_stages == [3, 2]
    assert not cfg.mlp_inside_blocks and cfg.mlp_width == 100  # a pattern's MLP width is d_intermediate as given


def test_a_hybrid_config_json_round_trips_with_its_own_fields(tmp_path):
    cfg = MambaConfig(
        d_model=64,
        n_layer=2,
        hybrid_layer_pattern="*-",
        attn_cfg=ATTN,
        d_intermediate=96,
        mlp_activation="squared_relu",
    )
    cfg.to_json(tmp_path / "config.json")
    assert MambaConfig.from_json(tmp_path / "config.json") == cfg
    assert json.loads((tmp_path / "config.json").read_text())["hybrid_layer_pattern"] == "*-"


def test_unknown_top_level_field_is_refused_by_name():
    with pytest.raises(ConfigError, match="hidden_size"):
        MambaConfig.from_dict({"d_model": 64, "hidden_size": 64})


def test_speed_switches_are_accepted():
    MambaConfig(d_model=64, n_layer=1, fused_add_norm=False, ssm_cfg={"use_fast_path": False})
    MambaConfig(d_model=64, n_layer=1, ssm_cfg={**M2, "use_mem_eff_path": False})
