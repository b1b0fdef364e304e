"""Expert parallelism through the real `deepspeed` launcher, on the tiny mixture-of-experts hybrid
(launch/models/tiny-moe-hybrid.json: MEM*E, 8 experts, sigmoid routing in groups, a shared expert, aux-loss-free
balancing, router losses) in float32: at EP 2 with dp 2 (ZeRO-1), EP 2 with tp 2 and sequence parallelism
(ZeRO-0: our clipping), EP 4 with dp 4 (ZeRO-2) and EP 2 over cp 2 with pp 2 (ZeRO-0; each rank's router losses
its slice's share: the layout of launch/configs/nemotron-3-nano-30b-a3b.json) the
5-step loss and gradient-norm curves equal the one-rank run's (spawned, the same entry point); the expert biases
move once per step by the tokens every expert received over all ranks; the metrics hold each MoE layer's load
and losses as one rank counts them; a checkpoint of the EP 2 run holds whole expert tensors and resumes at EP 1
on the one-rank curve, with its biases.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from distributed import free_port, run_ranks
from megamamba import MambaConfig
from megamamba.checkpoint.store import tag_for
from train_entry import DEEPSPEED, ROOT, TRAIN_PY, read_metrics, run_train
from train_runs import relative_curve_error

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 5, 2
TOLERANCE = 1e-4
MODEL = ROOT / "launch/models/tiny-moe-hybrid.json"
BIASES = "mixer.gate.e_score_correction_bias"
LAYOUTS = {
    # name: (ranks, flags, DeepSpeed config's zero_optimization stage)
    "dp2-ep2": (2, ["--expert-model-parallel-size", "2", "--save-interval", str(SAVE_AT)], 1),
    "dp2-tp2-sp-ep2": (4, ["--ep", "2", "--tp", "2", "--sequence-parallel"], 0),
    "dp4-ep4-zero2": (4, ["--ep", "4"], 2),
    "cp2-pp2-ep2": (4, ["--ep", "2", "--cp", "2", "--pp", "2"], 0),
}


def _argv(out: Path, zero_stage: int, flags=()) -> list:
    ds_config = out / "ds.json"
    config = json.loads((ROOT / "launch/configs/tiny-cpu.json").read_text())
    ds_config.write_text(json.dumps({**config, "zero_optimization": {"stage": zero_stage}}))
    return [
        *("--deepspeed_config", str(ds_config), "--model-config", str(MODEL)),
        *("--train-iters", str(STEPS), "--seq-length", "32", "--log-interval", "1", "--seed", "1234"),
        *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1"),
        *("--metrics-jsonl", str(out / "metrics.jsonl"), "--save", str(out / "ckpt")),
        *flags,
    ]


def _launch(out: Path, ranks: int, zero_stage: int, flags) -> dict:
    cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(free_port()), str(TRAIN_PY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, *_argv(out, zero_stage, flags)], cwd=out, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"records": read_metrics(out / "metrics.jsonl"), "save": out / "ckpt"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    out = {}
    for name in ("one", *LAYOUTS, "resumed-ep1"):
        (root / name).mkdir()
    argv = _argv(root / "one", 1, ["--save-interval", str(SAVE_AT)])
    ranks = run_ranks(run_train, 1, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False)
    out["one"] = {"records": ranks[0]["records"], "save": root / "one" / "ckpt"}
    for name, (ranks, flags, zero_stage) in LAYOUTS.items():
        out[name] = _launch(root / name, ranks, zero_stage, flags)
    resume = ["--load", str(out["dp2-ep2"]["save"] / tag_for(SAVE_AT))]
    out["resumed-ep1"] = _launch(root / "resumed-ep1", 1, 1, resume)
    return out


def _curve(run, key: str) -> list:
    return [r[key] for r in run["records"] if key in r]


def _model_tensors(save: Path, tag=None) -> dict:
    from megamamba.checkpoint import open_checkpoint

    return open_checkpoint(str(save / tag) if tag else "auto", None if tag else str(save)).model_tensors()


def _biases(save: Path) -> dict:
    return {k: v for k, v in _model_tensors(save).items() if k.endswith(BIASES)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_expert_parallel_layout_trains_the_one_rank_loss_and_gradient_norm_curves(runs, layout):
    for key in ("loss", "grad_norm"):
        curve, reference = _curve(runs[layout], key), _curve(runs["one"], key)
        assert len(curve) == STEPS, (key, curve)
        error = relative_curve_error(curve, reference)
        print(f"{layout}: max relative {key} difference to one rank {error:.1e}")
        assert error <= TOLERANCE, (key, curve, reference)


def test_the_expert_biases_move_once_per_step_by_the_tokens_every_expert_received(runs):
    one, split = _biases(runs["one"]["save"]), _biases(runs["dp2-ep2"]["save"])
    assert len(one) == 2 and all(bias.abs().sum() > 0 for bias in one.values()), one
    rate = MambaConfig.from_json(MODEL).moe_options.bias_update_rate
    for name, bias in one.items():  # STEPS updates of +-rate (or 0) each
        steps = bias / rate
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= STEPS, (name, bias)
        assert torch.equal(split[name], bias), name


@pytest.mark.parametrize("layout", ["dp4-ep4-zero2", "cp2-pp2-ep2"])
def test_every_record_holds_each_moe_layers_load_losses_and_bias_norm_over_all_ranks(runs, layout):
    one, split = runs["one"]["records"], runs[layout]["records"]
    figures = ("load_max_over_mean", "aux_loss", "expert_bias_norm")
    keys = [f"moe_layer{layer}_{figure}" for layer in (1, 4) for figure in figures]  # MEM*E: blocks 1 and 4
    assert all(set(keys) <= set(record) for record in one + split), one[0]
    assert all(r[k] >= 1 for r in one for k in keys if k.endswith("max_over_mean"))
    assert all(r[k] > 0 for r in one for k in keys if k.endswith("aux_loss"))
    for mine, reference in zip(split, one, strict=True):  # the tokens and losses of all ranks, as on one
        for key in keys:
            assert mine[key] == pytest.approx(reference[key], rel=1e-4), key
    saved = _biases(runs["one"]["save"])
    for layer in (1, 4):
        norm = saved[f"backbone.layers.{layer}.{BIASES}"].norm().item()
        assert one[-1][f"moe_layer{layer}_expert_bias_norm"] == pytest.approx(norm, rel=1e-6)


def test_an_ep2_checkpoint_holds_whole_experts_and_resumes_at_ep1_on_the_one_rank_curve(runs):
    saved = _model_tensors(runs["dp2-ep2"]["save"], tag_for(SAVE_AT))
    experts = MambaConfig.from_json(MODEL).moe_options.num_experts
    assert saved["backbone.layers.1.mixer.experts.up_proj"].shape[0] == experts
    curve, reference = _curve(runs["resumed-ep1"], "loss"), _curve(runs["one"], "loss")[SAVE_AT:]
    assert relative_curve_error(curve, reference) <= TOLERANCE, (curve, reference)
    resumed, final = _biases(runs["resumed-ep1"]["save"]), _biases(runs["one"]["save"])
    assert all(torch.equal(resumed[n], final[n]) for n in final)
