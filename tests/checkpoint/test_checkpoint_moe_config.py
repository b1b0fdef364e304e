"""A checkpoint's mixture-of-experts options compare with the run's as options, not as the JSON spelling them."""

from checkpoint_fixtures import tiny
from megamamba.checkpoint import config_differences

MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}


def moe_hybrid(**moe):
    return tiny("Mamba2", hybrid_layer_pattern="ME", moe_cfg={**MOE, **moe})


def test_a_moe_default_written_out_is_the_default():
    assert config_differences(moe_hybrid(), moe_hybrid(bias_update_rate=1e-3, capacity_factor=None)) == []


def test_a_changed_moe_option_is_named_with_both_values():
    assert config_differences(moe_hybrid(), moe_hybrid(top_k=1)) == ["moe_cfg.top_k: checkpoint 2, run 1"]
