"""DeepSpeed's "optimizer", "scheduler" and "bf16" blocks, translated to our AdamW, LR schedule and autocast."""

import json
import re

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

from megamamba.pipelines.config.layout import LayoutError
from megamamba.schedule.lr_schedule import LRSchedule
from train_entry import ROOT, load_train_script

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05}}
DEEPSPEED = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def _plan(tmp_path, ds, flags=(), train_iters=10):
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({**BATCH, **ds}))
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            str(ds_path),
            "--model-config",
            str(ROOT / "launch/models/tiny-mamba2.json"),
            "--train-iters",
            str(train_iters),
            *flags,
        ]
    )
    return script.prepare(args, 1)


def test_no_blocks_keep_todays_defaults_and_print_nothing(tmp_path):
    plan = _plan(tmp_path, {})
    assert plan.optimizer.schedule == LRSchedule(3e-4, 3e-5, 0, 10, "cosine")
    assert (plan.optimizer.weight_decay, plan.optimizer.betas, plan.optimizer.eps) == (0.1, (0.9, 0.95), 1e-8)
    assert plan.deepspeed_line is None


def test_flags_alone_set_every_optimizer_setting(tmp_path):
    plan = _plan(
        tmp_path,
        {},
        ["--lr", "1e-3", "--adam-beta1", "0.8", "--adam-beta2", "0.99", "--adam-eps", "1e-6", "--weight-decay", "0.05"],
    )
    assert (plan.optimizer.schedule.peak, plan.optimizer.betas) == (1e-3, (0.8, 0.99))
    assert (plan.optimizer.eps, plan.optimizer.weight_decay) == (1e-6, 0.05)


@pytest.mark.parametrize("kind, mode", [("AdamW", None), ("adamw", False), ("Adam", None), ("ADAM", True)])
def test_adam_and_adamw_blocks_become_torch_adamw(tmp_path, kind, mode):
    params = {**ADAMW["params"], **({} if mode is None else {"adam_w_mode": mode})}
    plan = _plan(tmp_path, {"optimizer": {"type": kind, "params": params}})
    assert (plan.optimizer.schedule.peak, plan.optimizer.betas) == (1e-3, (0.8, 0.99))
    assert (plan.optimizer.eps, plan.optimizer.weight_decay) == (1e-6, 0.05)
    assert plan.deepspeed_line == (
        f"train.py: DeepSpeed config: optimizer {kind}(lr=0.001, betas=(0.8, 0.99), "
        "eps=1e-06, weight_decay=0.05) -> fused torch AdamW; no scheduler block: LR "
        "schedule from the flags"
    )
    assert "optimizer" not in plan.engine_config


def test_missing_params_come_from_the_flags_then_the_defaults(tmp_path):
    plan = _plan(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, ["--weight-decay", "0.0"])
    assert (plan.optimizer.betas, plan.optimizer.eps, plan.optimizer.weight_decay) == ((0.9, 0.95), 1e-8, 0.0)


def test_l2_adam_without_weight_decay_is_adamw(tmp_path):
    plan = _plan(tmp_path, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0}}})
    assert plan.optimizer.weight_decay == 0


@pytest.mark.parametrize(
    "block, words",
    [
        (
            {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}},
            'optimizer Adam with "adam_w_mode": false adds weight_decay=0.01 x weights to the gradient (L2)',
        ),
        ({"type": "Lamb", "params": {"lr": 1e-3}}, "optimizer.type='Lamb': only Adam and AdamW are translated"),
        ({"type": "AdamW", "params": {"amsgrad": True}}, "optimizer.params ['amsgrad']: not translated"),
        ({"type": "AdamW", "params": {"bias_correction": False}}, "optimizer.params.bias_correction=False"),
        ({"type": "AdamW", "params": {"lr": "auto"}}, "optimizer.params.lr='auto': must be a number"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, "optimizer.params.betas=[0.9]: must be two numbers"),
    ],
)
def test_untranslatable_optimizer_blocks_are_refused_by_name(tmp_path, block, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _plan(tmp_path, {"optimizer": block})


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lr", "3e-4"], "--lr 0.0003 disagrees with the DeepSpeed config's optimizer.params.lr=0.001; keep one"),
        (
            ["--adam-beta2", "0.95"],
            "--adam-beta2 0.95 disagrees with the DeepSpeed config's optimizer.params.betas[1]=0.99",
        ),
        (["--adam-eps", "1e-8"], "--adam-eps 1e-08 disagrees with the DeepSpeed config's optimizer.params.eps=1e-06"),
        (
            ["--weight-decay", "0.1"],
            "--weight-decay 0.1 disagrees with the DeepSpeed config's optimizer.params.weight_decay",
        ),
    ],
)
def test_a_flag_disagreeing_with_the_optimizer_block_is_refused(tmp_path, flags, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _plan(tmp_path, {"optimizer": ADAMW}, flags)


def test_flags_agreeing_with_the_json_are_accepted(tmp_path):
    plan = _plan(tmp_path, {"optimizer": ADAMW}, ["--lr", "1e-3", "--weight-decay", "0.05"])
    assert plan.optimizer.schedule.peak == 1e-3


SCHEDULERS = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}},
    {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4, "total_num_steps": 12, "warmup_type": "linear"},
    },
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 2e-5, "warmup_num_steps": 6, "total_num_steps": 9}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 15, "warmup_num_steps": 4}},
    {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 11,
            "warmup_num_steps": 3,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    },
]


@pytest.mark.parametrize("block", SCHEDULERS, ids=lambda b: b["type"])
def test_each_scheduler_gives_deepspeeds_lr_at_every_step(tmp_path, block):
    plan = _plan(tmp_path, {"optimizer": ADAMW, "scheduler": block}, train_iters=20)
    param = torch.nn.Parameter(torch.zeros(1))
    theirs = torch.optim.SGD([param], lr=1e-3)  # the optimizer DeepSpeed builds from ADAMW has lr 1e-3
    scheduler = DEEPSPEED[block["type"]](theirs, **block["params"])
    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=plan.schedule.peak)
    our_scheduler = plan.schedule.scheduler(ours)
    for step in range(20):  # the lr optimizer step `step` runs at
        expected = theirs.param_groups[0]["lr"]
        assert plan.schedule(step) == pytest.approx(expected, rel=1e-12, abs=0), step
        assert ours.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=0), step
        scheduler.step()
        ours.step()
        our_scheduler.step()


def test_the_startup_line_says_what_each_block_became(tmp_path):
    plan = _plan(tmp_path, {"optimizer": ADAMW, "scheduler": SCHEDULERS[2], "bf16": {"enabled": True}})
    assert plan.deepspeed_line == (
        "train.py: DeepSpeed config: optimizer AdamW(lr=0.001, betas=(0.8, 0.99), eps=1e-06, weight_decay=0.05) -> "
        "fused torch AdamW; scheduler WarmupDecayLR(total_num_steps=12, warmup_min_lr=0.0, warmup_max_lr=0.001, "
        "warmup_num_steps=4, warmup_type=linear) -> LR schedule peak 0.001, linear warm-up from 0 over 4 steps, "
        "linear decay to 0 at step 12; bf16 -> torch_autocast bf16 (float32 parameters, the SSM's A_log, D, dt_bias "
        "included)"
    )


def test_bf16_becomes_torch_autocast_and_no_translated_block_reaches_deepspeed(tmp_path):
    plan = _plan(
        tmp_path,
        {"optimizer": ADAMW, "scheduler": SCHEDULERS[0], "bf16": {"enabled": True}, "fp16": {"enabled": False}},
    )
    assert not {"optimizer", "scheduler", "bf16", "fp16"} & set(plan.engine_config)
    assert plan.engine_config["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": [],
    }


@pytest.mark.parametrize(
    "block, flags, words",
    [
        (
            {"type": "OneCycle", "params": {}},
            [],
            "scheduler.type='OneCycle': only WarmupLR, WarmupDecayLR, WarmupCosineLR",
        ),
        (
            {"type": "WarmupLR", "params": {"total_num_steps": 5}},
            [],
            "scheduler.params ['total_num_steps']: WarmupLR takes",
        ),
        (
            {"type": "WarmupDecayLR", "params": {}},
            [],
            "scheduler.params.total_num_steps=None: must be a positive integer",
        ),
        ({"type": "WarmupLR", "params": {"warmup_type": "exp"}}, [], "scheduler.params.warmup_type='exp'"),
        ({"type": "WarmupLR", "params": {"last_batch_iteration": 4}}, [], "resuming is --load's job"),
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            ["--lr-warmup-iters", "5"],
            "--lr-warmup-iters 5 disagrees with the DeepSpeed config's WarmupLR (10); keep one",
        ),
        (
            {"type": "WarmupLR", "params": {}},
            ["--min-lr", "1e-5"],
            "--min-lr 1e-05 disagrees with the DeepSpeed config's WarmupLR (no such setting)",
        ),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 8}},
            ["--lr-decay-iters", "9"],
            "--lr-decay-iters 9 disagrees with the DeepSpeed config's WarmupDecayLR (8)",
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 8}},
            ["--lr-decay-style", "linear"],
            "--lr-decay-style linear disagrees with the DeepSpeed config's WarmupCosineLR (cosine)",
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 8}},
            ["--lr-warmup-fraction", "0.1"],
            "--lr-warmup-fraction 0.1 and the DeepSpeed config's scheduler.params.warmup_num_steps "
            "both set the warm-up",
        ),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 8}},
            ["--lr", "3e-4"],  # DeepSpeed's default max
            "--lr 0.0003 disagrees with the DeepSpeed config's scheduler.params.warmup_max_lr=0.001",
        ),
    ],
)
def test_untranslatable_or_conflicting_schedulers_are_refused_by_name(tmp_path, block, flags, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _plan(tmp_path, {"scheduler": block}, flags)


def test_scheduler_flags_that_agree_are_accepted(tmp_path):
    block = {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 2, "cos_min_ratio": 0.1}}
    plan = _plan(
        tmp_path,
        {"optimizer": ADAMW, "scheduler": block},
        ["--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--min-lr", "1e-4", "--lr-decay-style", "cosine"],
    )
    assert plan.schedule(8) == pytest.approx(1e-4)


def test_fp16_is_refused_for_its_loss_scaling(tmp_path):
    with pytest.raises(LayoutError, match="float16 needs loss scaling"):
        _plan(tmp_path, {"fp16": {"enabled": True}})
