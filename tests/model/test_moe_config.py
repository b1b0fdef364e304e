"""moe_cfg, the mixture-of-experts blocks' options: refused with one message naming the option and the rule,
coupled to the E letters of hybrid_layer_pattern, and left out of config.json when there are none."""

import pytest

from megamamba import MambaConfig
from megamamba.config import ConfigError

MOE = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 16}


def config(moe_cfg=None, pattern="ME") -> MambaConfig:
    return MambaConfig(
        d_model=16, n_layer=len(pattern), vocab_size=32, hybrid_layer_pattern=pattern, moe_cfg=moe_cfg or {}
    )


@pytest.mark.parametrize(
    "moe_cfg, message",
    [
        ({**MOE, "experts": 4}, "moe_cfg.experts=4 is not a mixture-of-experts option"),
        ({"num_experts": 8, "top_k": 2}, "moe_cfg has no ffn_hidden_size"),
        ({**MOE, "num_experts": 0}, "moe_cfg.num_experts=0: must be a positive integer"),
        ({**MOE, "top_k": 9}, "moe_cfg.top_k=9: more than num_experts=8"),
        ({**MOE, "shared_expert_ffn_hidden_size": -1}, "moe_cfg.shared_expert_ffn_hidden_size=-1: must be"),
        ({**MOE, "activation": "gelu"}, "moe_cfg.activation='gelu': choose one of ('relu2', 'gated_silu')"),
        ({**MOE, "score_function": "sqrtsoftplus"}, "moe_cfg.score_function='sqrtsoftplus': choose one of"),
        ({**MOE, "aux_loss_type": "global_aux_loss"}, "moe_cfg.aux_loss_type='global_aux_loss': choose one of"),
        ({**MOE, "expert_bias": 1}, "moe_cfg.expert_bias=1: must be true or false"),
        ({**MOE, "bias_update_rate": -0.1}, "moe_cfg.bias_update_rate=-0.1: must be a number >= 0"),
        ({**MOE, "routed_scaling_factor": 0}, "moe_cfg.routed_scaling_factor=0: must be a positive number"),
        ({**MOE, "capacity_factor": 0}, "moe_cfg.capacity_factor=0: must be a positive number"),
        ({**MOE, "n_group": 3}, "moe_cfg.n_group=3: num_experts=8 is not divisible by it"),
        ({**MOE, "n_group": 2, "topk_group": 3}, "moe_cfg.topk_group=3: more than n_group=2"),
        ({**MOE, "n_group": 8}, "moe_cfg.n_group=8: groups of 1 expert"),
        ({**MOE, "n_group": 4, "topk_group": 1, "top_k": 3}, "moe_cfg.top_k=3: more than the 2 experts"),
    ],
)
def test_a_bad_moe_option_is_refused_by_name(moe_cfg, message):
    with pytest.raises(ConfigError) as refused:
        config(moe_cfg)
    assert str(refused.value).startswith(message)


def test_moe_layers_need_moe_cfg_and_moe_cfg_needs_moe_layers():
    with pytest.raises(ConfigError, match=r"has mixture-of-experts layers \(E\) but no moe_cfg"):
        config({})
    with pytest.raises(ConfigError, match="with no mixture-of-experts layer: add E to hybrid_layer_pattern"):
        config(MOE, pattern="MM")


def test_moe_cfg_round_trips_through_config_json_and_is_absent_without_moe_layers(tmp_path):
    moe = config({**MOE, "expert_bias": True, "capacity_factor": 1.25})
    moe.to_json(tmp_path / "config.json")
    assert MambaConfig.from_json(tmp_path / "config.json") == moe
    assert moe.moe_options.capacity_factor == 1.25 and moe.block_kinds == ["mamba", "moe"]
    assert "moe_cfg" not in config(pattern="MM").to_dict()
