"""launch/train.py on the tiny mixture-of-experts hybrid with aux-loss-free balancing (expert_bias), ZeRO-1,
float32, on spawned gloo ranks: the expert biases move after every applied step by the tokens every expert
received over the data-parallel ranks (dp 2 ends with the one-rank run's biases), a checkpoint holds them
though the optimizer leaves them alone, and a resume continues the loss curve exactly."""

import os
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from megamamba import MambaConfig
from megamamba.checkpoint.store import tag_for
from train_entry import ROOT, run_train

STEPS, SAVE_AT = 4, 2
TOLERANCE = 1e-4
BIASES = "mixer.gate.e_score_correction_bias"
MODEL = ROOT / "launch/models/tiny-moe-hybrid.json"  # expert_bias true


def _argv(out: Path, flags=()) -> list:
    return [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(MODEL),
        "--train-iters",
        str(STEPS),
        "--seq-length",
        "32",
        "--log-interval",
        "1",
        "--lr",
        "1e-3",
        "--seed",
        "1234",
        "--metrics-jsonl",
        str(out / "metrics.jsonl"),
        "--save",
        str(out / "ckpt"),
        *flags,
    ]


def _run(root: Path, name: str, world: int, flags=()) -> dict:
    out = root / name
    out.mkdir()
    argv = _argv(out, flags)
    ranks = run_ranks(
        run_train, world, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False, timeout=300
    )
    return {"records": ranks[0]["records"], "save": out / "ckpt"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_runs")
    one = _run(root, "one", 1, ["--save-interval", str(SAVE_AT)])
    return {
        "one": one,
        "dp2": _run(root, "dp2", 2),
        "resumed": _run(root, "resumed", 1, ["--load", str(one["save"] / tag_for(SAVE_AT))]),
    }


def _biases(save: Path, tag=None) -> dict:
    from megamamba.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(str(save / tag) if tag else "auto", None if tag else str(save))
    return {k: v for k, v in checkpoint.model_tensors().items() if k.endswith(BIASES)}


def _losses(run) -> list:
    return [r["loss"] for r in run["records"]]


def test_the_expert_biases_move_once_per_step_by_the_tokens_received_over_the_data_parallel_ranks(runs):
    one, dp2 = _biases(runs["one"]["save"]), _biases(runs["dp2"]["save"])
    assert len(one) == 2 and all(bias.abs().sum() > 0 for bias in one.values()), one
    rate = MambaConfig.from_json(MODEL).moe_options.bias_update_rate
    for name, bias in one.items():  # STEPS updates of +-rate (or 0) each
        steps = bias / rate
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= STEPS, (name, bias)
        assert torch.equal(dp2[name], bias), name
    curve, reference = _losses(runs["dp2"]), _losses(runs["one"])
    assert max(abs(a - b) / b for a, b in zip(curve, reference)) <= TOLERANCE, (curve, reference)


def test_a_resume_from_a_zero_checkpoint_continues_the_loss_curve_and_the_biases_exactly(runs):
    saved = _biases(runs["one"]["save"], tag_for(SAVE_AT))
    final = _biases(runs["one"]["save"])
    assert any(not torch.equal(saved[n], final[n]) for n in saved)  # the biases kept moving after the save
    assert _losses(runs["resumed"]) == _losses(runs["one"])[SAVE_AT:]
    resumed = _biases(runs["resumed"]["save"])
    assert all(torch.equal(resumed[n], final[n]) for n in final)


def test_every_record_holds_each_moe_layers_load_losses_and_bias_norm_over_all_ranks(runs):
    one, dp2 = runs["one"]["records"], runs["dp2"]["records"]
    figures = ("load_max_over_mean", "aux_loss", "expert_bias_norm")
    keys = [f"moe_layer{layer}_{figure}" for layer in (1, 4) for figure in figures]  # MEM*E: blocks 1 and 4
    assert all(set(keys) <= set(record) for record in one + dp2), one[0]
    assert all(r[k] >= 1 for r in one for k in keys if k.endswith("max_over_mean"))
    assert all(r[k] > 0 for r in one for k in keys if k.endswith("aux_loss"))
    for mine, reference in zip(dp2, one):  # the tokens and losses of both data-parallel ranks, as on one
        assert mine.keys() == reference.keys()
        for key in keys:
            assert mine[key] == pytest.approx(reference[key], rel=1e-4), key
    saved = _biases(runs["one"]["save"])
    for layer in (1, 4):
        norm = saved[f"backbone.layers.{layer}.{BIASES}"].norm().item()
        assert one[-1][f"moe_layer{layer}_expert_bias_norm"] == pytest.approx(norm, rel=1e-6)
