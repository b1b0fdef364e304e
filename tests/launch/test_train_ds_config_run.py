"""An unedited DeepSpeed-style config (AdamW + WarmupDecayLR + bf16, ZeRO 1) trains through launch/train.py."""

import json
import os

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupDecayLR

from distributed import run_ranks
from train_entry import ROOT, run_train

pytestmark = pytest.mark.slow

STEPS = 6
SCHEDULER = {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3, "total_num_steps": 5}
DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": SCHEDULER},
    "bf16": {"enabled": True},
}
# The same settings as flags (DeepSpeed's log warm-up is the default; flags that agree are accepted).
FLAGS = [
    "--lr",
    "1e-3",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.95",
    "--adam-eps",
    "1e-8",
    "--weight-decay",
    "0.1",
    "--min-lr",
    "0",
    "--lr-warmup-iters",
    "3",
    "--lr-decay-iters",
    "5",
    "--lr-decay-style",
    "linear",
]


def _run_recording_dtypes(argv, extensions_dir):
    """`run_train`'s rank, its summary with the dtypes of the trainer's parameters ("parameter_dtypes")."""
    from megamamba.pipelines.job import run

    dtypes: set = set()
    build = run.build_trainer

    def build_trainer(*args, **kwargs):
        trainer = build(*args, **kwargs)
        dtypes.update(str(p.dtype) for _, _, p in trainer.named_parameters())
        return trainer

    run.build_trainer = build_trainer
    return {**run_train(argv, extensions_dir), "parameter_dtypes": sorted(dtypes)}


def _run(tmp_path, name, flags=()):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(DS_CONFIG))
    argv = [
        "--deepspeed_config",
        str(path),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba2.json"),
        "--train-iters",
        str(STEPS),
        "--seq-length",
        "32",
        "--log-interval",
        "1",
        "--seed",
        "1234",
        *flags,
    ]
    return run_ranks(
        _run_recording_dtypes, 1, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False, timeout=400
    )[0]


def _deepspeed_lrs() -> list:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler, lrs = WarmupDecayLR(optimizer, **SCHEDULER), []
    for _ in range(STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def test_an_unedited_deepspeed_config_trains_with_deepspeeds_lr_curve_and_float32_parameters(tmp_path):
    run = _run(tmp_path, "json")
    lrs = [r["lr"] for r in run["records"]]
    assert lrs == pytest.approx(_deepspeed_lrs(), rel=1e-12, abs=0)
    assert run["parameter_dtypes"] == ["torch.float32"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in run["records"])
    same = _run(tmp_path, "json-and-flags", FLAGS)
    assert [r["lr"] for r in same["records"]] == lrs
    assert [r["loss"] for r in same["records"]] == [r["loss"] for r in run["records"]]
