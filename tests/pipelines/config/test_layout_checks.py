"""Every inconsistent run is refused before training, with one message naming the values and the rule."""

import dataclasses
import json
import re

import pytest

from megamamba import MambaConfig, MambaLM
from megamamba.pipelines.config.layout import Layout, LayoutError, check_run, engine_config, resolve_layout
from train_entry import ROOT, load_train_script

TINY = MambaConfig.from_json(ROOT / "launch/models/tiny-mamba2.json")
BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize(
    "world, tp, pp, config, expect",
    [
        (4, 1, 2, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (2, 1, 2, 2, 2)),
        (8, 2, 2, {"train_batch_size": 8, "gradient_accumulation_steps": 2}, (2, 2, 2, 2, 2)),
        (2, 1, 1, {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (2, 1, 1, 3, 2)),
        (1, 1, 1, {"train_batch_size": 6}, (1, 1, 1, 6, 1)),
        (
            6,
            3,
            1,
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
            (2, 3, 1, 4, 1),
        ),
    ],
)
def test_data_parallel_size_and_batch_split_follow_from_world_tp_pp_and_the_json(world, tp, pp, config, expect):
    layout = resolve_layout(world, tp, pp, config)
    assert (layout.dp, layout.tp, layout.pp, layout.micro_batch_size, layout.grad_accum) == expect


@pytest.mark.parametrize(
    "world, tp, pp, config, words",
    [
        (6, 2, 2, BATCH, "world size 6 is not a multiple of tensor x pipeline parallel size 2 x 2 = 4"),
        (
            4,
            1,
            1,
            {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1},
            "train_batch_size=6 is not divisible by train_micro_batch_size_per_gpu x data-parallel size = 1 x 4",
        ),
        (
            2,
            1,
            1,
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
            "train_batch_size=8 != train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size "
            "= 2 x 4 x 2 = 16",
        ),
        (
            2,
            1,
            1,
            {"gradient_accumulation_steps": 4},
            "sets neither train_batch_size nor train_micro_batch_size_per_gpu",
        ),
        (2, 0, 1, BATCH, "--tensor-parallel-size=0: must be a positive integer"),
        (2, 1, 1, {"train_batch_size": 0}, "train_batch_size=0: must be a positive integer"),
    ],
)
def test_inconsistent_world_or_batch_sizes_are_refused(world, tp, pp, config, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        resolve_layout(world, tp, pp, config)


def _layout(dp=1, tp=1, pp=1):
    return Layout(dp * tp * pp, dp, tp, pp, 2, 1)


@pytest.mark.parametrize(
    "layout, ds_extra, model, seq, sp, clip, words",
    [
        (
            _layout(pp=2),
            {"zero_optimization": {"stage": 2}},
            TINY,
            64,
            False,
            None,
            "ZeRO stage 2 with pipeline parallel size 2",
        ),
        (
            _layout(pp=2),
            {"zero_optimization": {"stage": 3}},
            TINY,
            64,
            False,
            None,
            "ZeRO stage 3 with pipeline parallel size 2",
        ),
        (_layout(), {"zero_optimization": {"stage": 4}}, TINY, 64, False, None, "zero_optimization.stage=4"),
        (
            _layout(pp=4),
            {},
            dataclasses.replace(TINY, n_layer=3),
            64,
            False,
            None,
            "n_layer=3 is smaller than pipeline parallel size 4",
        ),
        (_layout(), {}, TINY, 64, True, None, "--sequence-parallel needs --tensor-parallel-size > 1"),
        (_layout(tp=2), {}, TINY, 63, True, None, "--seq-length 63 is not divisible by tensor parallel size 2"),
        (_layout(), {"gradient_clipping": 1.0}, TINY, 64, False, 0.5, "gradient clipping set twice"),
        (
            _layout(),
            {"bf16": {"enabled": True, "immediate_grad_update": True}},
            TINY,
            64,
            False,
            None,
            'only "enabled": true/false is translated',
        ),
        (
            _layout(),
            {"bf16": {"enabled": True}, "torch_autocast": {"enabled": False}},
            TINY,
            64,
            False,
            None,
            '"bf16": {"enabled": true} and "torch_autocast": {"enabled": false} disagree',
        ),
        (_layout(), {"fp16": {"enabled": True}}, TINY, 64, False, None, "float16 needs loss scaling"),
        (
            _layout(pp=2),
            {"pipeline": {"activation_checkpoint_interval": 1}},
            TINY,
            64,
            False,
            None,
            "use --checkpoint-activations-interval 1",
        ),
        (
            _layout(),
            {"torch_autocast": {"enabled": True, "dtype": "float16"}},
            TINY,
            64,
            False,
            None,
            "only bfloat16 is supported",
        ),
        (_layout(), {}, TINY, 0, False, None, "--seq-length=0"),
        (_layout(tp=3), {}, TINY, 63, False, None, "nheads = 8 (d_inner 128 / headdim 16) is not divisible by TP = 3"),
        (
            _layout(tp=3),
            {},
            MambaConfig.from_json(ROOT / "launch/models/tiny-mamba1.json"),
            63,
            False,
            None,
            "d_inner = 128 (expand x d_model) is not divisible by TP = 3",
        ),
    ],
)
def test_inconsistent_runs_are_refused(layout, ds_extra, model, seq, sp, clip, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        check_run(layout, {**BATCH, **ds_extra}, model, seq, sp, clip)


def test_valid_runs_pass_every_check():
    check_run(_layout(pp=2), {**BATCH, "zero_optimization": {"stage": 1}}, TINY, 64, False, 1.0)
    check_run(
        _layout(dp=2),
        {
            **BATCH,
            "zero_optimization": {"stage": 3},
            "gradient_clipping": 0.5,
            "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        },
        TINY,
        64,
        False,
        None,
    )


def test_engine_config_fills_the_batch_keys_sets_clipping_and_keeps_tensorboard_for_us():
    layout = resolve_layout(4, 1, 2, BATCH)
    config = engine_config({**BATCH, "tensorboard": {"enabled": True}}, layout, None, False)
    assert config["gradient_accumulation_steps"] == 2 and config["gradient_clipping"] == 1.0
    assert "tensorboard" not in config
    assert engine_config(BATCH, layout, 0.3, False)["gradient_clipping"] == 0.3
    assert engine_config({**BATCH, "gradient_clipping": 0.7}, layout, None, False)["gradient_clipping"] == 0.7
    sp = engine_config(BATCH, layout, None, True)["pipeline"]
    assert sp["pipe_partitioned"] is False and sp["grad_partitioned"] is False


def test_engine_config_turns_off_the_synchronizing_throughput_timer_unless_the_json_sets_it():
    layout = resolve_layout(1, 1, 1, BATCH)
    assert engine_config(BATCH, layout, None, False)["timers"] == {"throughput": {"enabled": False}}
    mine = {"throughput": {"enabled": True, "synchronized": False}}
    assert engine_config({**BATCH, "timers": mine}, layout, None, False)["timers"] == mine


def test_engine_config_reduces_autocast_gradients_in_float32_unless_the_json_names_modules():
    layout = resolve_layout(1, 1, 1, BATCH)
    autocast = {"enabled": True, "dtype": "bfloat16"}
    config = engine_config({**BATCH, "torch_autocast": autocast}, layout, None, False)
    assert config["torch_autocast"] == {**autocast, "lower_precision_safe_modules": []}
    mine = {**autocast, "lower_precision_safe_modules": ["torch.nn.Linear"]}
    assert engine_config({**BATCH, "torch_autocast": mine}, layout, None, False)["torch_autocast"] == mine
    assert "torch_autocast" not in engine_config(BATCH, layout, None, False)


def _prepare(tmp_path, world=1, ds=None, model=None, flags=()):
    ds_path, model_path = tmp_path / "ds.json", tmp_path / "model.json"
    ds_path.write_text(json.dumps(BATCH if ds is None else ds))
    model_path.write_text(json.dumps(TINY.to_dict() if model is None else model))
    script = load_train_script()
    args = script.parse_args(
        ["--deepspeed_config", str(ds_path), "--model-config", str(model_path), "--train-iters", "10", *flags]
    )
    return script.prepare(args, world)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lr-warmup-iters", "11"], "warm-up iters 11"),
        (["--min-lr", "1.0", "--lr", "0.1"], "min lr 1.0"),
        (["--partition-method", "balanced"], "partition method 'balanced'"),
        (["--checkpoint-activations-interval", "-1"], "--checkpoint-activations-interval -1"),
        (["--max-skipped-steps", "0"], "--max-skipped-steps 0: must be >= 1"),
        (["--step-timeout", "-1"], "--step-timeout -1.0: must be >= 0"),
    ],
)
def test_bad_flags_are_refused_before_any_process_group(tmp_path, flags, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _prepare(tmp_path, flags=flags)


def test_a_model_whose_vocabulary_cannot_hold_the_tokenizers_is_refused(tmp_path):
    with pytest.raises(LayoutError, match="has 257 ids but the model config's vocab_size is 200"):
        _prepare(tmp_path, model={**TINY.to_dict(), "vocab_size": 200})


# Every published mamba_ssm size (its config.json values) and a 7B-class Mamba-2; parameters in billions.
GPU_SIZES = [
    ("mamba1-130m", 0.129),
    ("mamba1-370m", 0.372),
    ("mamba1-790m", 0.793),
    ("mamba1-1.4b", 1.372),
    ("mamba1-2.8b", 2.768),
    ("mamba2-130m", 0.129),
    ("mamba2-370m", 0.368),
    ("mamba2-780m", 0.780),
    ("mamba2-1.3b", 1.344),
    ("mamba2-2.7b", 2.703),
    ("mamba2-7b", 7.223),
]


@pytest.mark.parametrize("name", [s for s, _ in GPU_SIZES])
@pytest.mark.parametrize("world, tp, pp", [(1, 1, 1), (8, 1, 2), (16, 1, 4), (8, 2, 2), (8, 8, 1)])
def test_gpu_configs_pass_every_check_with_zero1_and_bf16_autocast(name, world, tp, pp):
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            str(ROOT / f"launch/configs/{name}.json"),
            "--model-config",
            str(ROOT / f"launch/models/{name}.json"),
            "--train-iters",
            "100",
            "--seq-length",
            "2048",
            "--tp",
            str(tp),
            "--pp",
            str(pp),
        ]
    )
    plan = script.prepare(args, world)
    assert plan.engine_config["torch_autocast"]["enabled"] and plan.engine_config["zero_optimization"]["stage"] == 1
    assert plan.monitors.tensorboard_dir == f"runs/{name}"


@pytest.mark.parametrize("name, billions", GPU_SIZES)
def test_gpu_model_configs_have_their_published_size(name, billions):
    config = MambaConfig.from_json(ROOT / f"launch/models/{name}.json")
    params = sum(p.numel() for p in MambaLM(config, device="meta").parameters())
    assert abs(params / 1e9 - billions) < 0.001, params


def test_a_malformed_json_config_is_refused_by_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            str(bad),
            "--model-config",
            str(ROOT / "launch/models/tiny-mamba2.json"),
            "--train-iters",
            "3",
        ]
    )
    with pytest.raises(LayoutError, match="--deepspeed_config .*bad.json"):
        script.prepare(args, 1)


def test_the_plan_takes_tensorboard_from_the_json_when_no_log_dir(tmp_path):
    plan = _prepare(tmp_path, ds={**BATCH, "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"}})
    assert plan.monitors.tensorboard_dir == "tb/j" and plan.layout.grad_accum == 4
    plan = _prepare(tmp_path, ds={**BATCH, "tensorboard": {"enabled": True}}, flags=["--log-dir", "mine"])
    assert plan.monitors.tensorboard_dir == "mine"


def _plan(tmp_path, flags, ds=None, name="ds.json"):
    ds_path, model_path = tmp_path / name, tmp_path / "model.json"
    ds_path.write_text(ds if isinstance(ds, str) else json.dumps(BATCH if ds is None else ds))
    model_path.write_text(json.dumps(TINY.to_dict()))
    script = load_train_script()
    return script.prepare(
        script.parse_args(["--deepspeed_config", str(ds_path), "--model-config", str(model_path), *flags]), 4
    )


def _schedule(plan, steps=12):
    return [plan.schedule(s) for s in range(steps)]


@pytest.mark.parametrize(
    "megatron, ours",
    [
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
        ),
        (["--data-path"], ["--data"]),
        (["--train-samples", "80"], ["--train-iters", "10"]),
        (
            ["--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-fraction", "0.25"],
            ["--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-iters", "2"],
        ),
    ],
)
def test_megatron_flag_names_give_the_plan_of_ours(tmp_path, megatron, ours):
    base = [] if any(f.startswith("--train-") for f in megatron) else ["--train-iters", "10"]
    theirs, mine = _plan(tmp_path, base + megatron), _plan(tmp_path, base + ours)
    assert theirs.layout == mine.layout and theirs.train_iters == mine.train_iters
    assert _schedule(theirs) == _schedule(mine)


def test_lr_decay_iters_ends_the_decay_before_the_last_step(tmp_path):
    plan = _plan(tmp_path, ["--train-iters", "10", "--lr-decay-iters", "6", "--min-lr", "1e-5"])
    assert plan.train_iters == 10 and plan.schedule(6) == plan.schedule(9) == pytest.approx(1e-5)


def test_batch_flags_set_the_json_keys_and_a_disagreeing_json_is_refused(tmp_path):
    plan = _plan(
        tmp_path,
        ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "16"],
        ds={"zero_optimization": {"stage": 1}},
    )
    assert (plan.layout.micro_batch_size, plan.layout.grad_accum, plan.layout.global_batch_size) == (1, 4, 16)
    with pytest.raises(
        LayoutError,
        match=r"--global-batch-size 16 disagrees with the DeepSpeed config's "
        r"train_batch_size=8; keep one",
    ):
        _plan(tmp_path, ["--train-iters", "3", "--global-batch-size", "16"])


@pytest.mark.parametrize(
    "flags, words",
    [
        ([], "give exactly one of --train-iters and --train-samples"),
        (["--train-iters", "3", "--train-samples", "24"], "give exactly one of --train-iters and --train-samples"),
        (["--train-samples", "7"], "--train-samples 7 is less than one global batch (8)"),
        (["--train-iters", "9", "--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "both set the warm-up"),
        (["--train-iters", "9", "--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5: must lie in [0, 1]"),
    ],
)
def test_conflicting_or_missing_length_and_warmup_flags_are_refused(tmp_path, flags, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _plan(tmp_path, flags)


def test_flag_abbreviations_are_refused_and_deepspeeds_own_flag_is_accepted(capsys):
    script = load_train_script()
    base = ["--deepspeed_config", "ds.json", "--model-config", "m.json", "--train-iters", "3"]
    assert script.parse_args(["--deepspeed", *base]).deepspeed
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args([*base, "--lr-warmup", "5"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --lr-warmup 5" in capsys.readouterr().err


def test_a_deepspeed_config_with_comments_is_read_as_deepspeed_reads_it(tmp_path):
    hjson_text = '{\n  // DeepSpeed reads hjson\n  "train_batch_size": 8,\n  train_micro_batch_size_per_gpu: 2\n}\n'
    assert _plan(tmp_path, ["--train-iters", "3"], ds=hjson_text).layout.grad_accum == 1
