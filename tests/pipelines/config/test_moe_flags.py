"""Megatron's mixture-of-experts flags set the model config's moe_cfg as launch/train.py plans a run; a flag the
--model-config file contradicts is refused in one line."""

import json

import pytest

from megamamba.config import MoEOptions
from megamamba.pipelines.config.layout import LayoutError
from megamamba.pipelines.config.moe_flags import moe_cfg_flags
from megamamba.pipelines.config.run_plan import model_config
from train_entry import ROOT, load_train_script

BASE = json.loads((ROOT / "launch/models/tiny-moe-hybrid.json").read_text())
MEGATRON = [
    "--num-experts", "16",
    "--moe-router-topk", "4",
    "--moe-ffn-hidden-size", "24",
    "--moe-shared-expert-intermediate-size", "0",
    "--moe-router-score-function", "softmax",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0.01",
    "--moe-router-topk-scaling-factor", "2.0",
    "--moe-router-num-groups", "4",
    "--moe-router-group-topk", "2",
    "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.002",
    "--moe-expert-capacity-factor", "1.5",
]  # fmt: skip


def _model(tmp_path, moe_cfg, flags):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**BASE, "moe_cfg": moe_cfg}))
    args = load_train_script().parse_args(["--deepspeed_config", "ds.json", "--model-config", str(path), *flags])
    return model_config(args.model_config, args.hybrid_layer_pattern, moe_cfg_flags(args)), path


def test_megatrons_flags_fill_moe_cfg(tmp_path):
    model, _ = _model(tmp_path, {"activation": "relu2"}, MEGATRON)
    assert model.moe_options == MoEOptions(
        num_experts=16,
        top_k=4,
        ffn_hidden_size=24,
        shared_expert_ffn_hidden_size=0,
        activation="relu2",
        score_function="softmax",
        expert_bias=True,
        bias_update_rate=0.01,
        routed_scaling_factor=2.0,
        n_group=4,
        topk_group=2,
        aux_loss_type="aux_loss",
        aux_loss_coeff=0.01,
        z_loss_coeff=0.002,
        capacity_factor=1.5,
    )


def test_a_flag_the_model_config_agrees_with_is_applied_and_one_it_contradicts_is_refused(tmp_path):
    model, _ = _model(tmp_path, BASE["moe_cfg"], ["--moe-router-topk", "2"])
    assert model.moe_options.top_k == 2
    with pytest.raises(LayoutError) as refusal:
        _model(tmp_path, BASE["moe_cfg"], ["--num-experts", "4"])
    assert str(refusal.value) == (
        f"--num-experts 4 disagrees with --model-config '{tmp_path / 'model.json'}''s moe_cfg.num_experts=8; keep one"
    )


def test_a_value_moe_cfg_cannot_take_is_refused_naming_the_flags(tmp_path):
    with pytest.raises(LayoutError) as refusal:
        moe_cfg = {k: v for k, v in BASE["moe_cfg"].items() if k != "top_k"}
        _model(tmp_path, moe_cfg, ["--moe-router-topk", "0", "--moe-router-enable-expert-bias"])
    assert str(refusal.value).startswith(
        f"--moe-router-topk 0 --moe-router-enable-expert-bias with --model-config '{tmp_path / 'model.json'}': "
        "moe_cfg.top_k=0"
    )
