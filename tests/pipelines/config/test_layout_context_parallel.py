"""--context-parallel-size C in the run's layout: world = dp x cp x tp x pp, the global batch counts dp
replicas (the C ranks of a group share their samples), DeepSpeed's data axis holds dp x C ranks, and
layouts CP cannot run are refused before any process group with one message."""

import json
import re
import subprocess
import sys

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import LayoutError, check_run, engine_config, resolve_layout
from train_entry import ROOT, TRAIN_PY, load_train_script

TINY = MambaConfig.from_json(ROOT / "launch/models/tiny-mamba2.json")
BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize(
    "world, cp, tp, pp, expect",
    [
        (2, 2, 1, 1, (1, 4)),
        (4, 2, 2, 1, (1, 4)),
        (8, 2, 1, 2, (2, 2)),
        (8, 4, 1, 1, (2, 2)),
    ],
)
def test_data_parallel_size_is_world_over_context_tensor_and_pipeline(world, cp, tp, pp, expect):
    layout = resolve_layout(world, tp, pp, BATCH, cp)
    assert (layout.dp, layout.grad_accum) == expect
    assert (layout.cp, layout.global_batch_size) == (cp, 8)


def test_deepspeed_counts_a_micro_batch_on_every_rank_of_its_data_axis():
    layout = resolve_layout(8, 1, 2, BATCH, 2)
    config = engine_config(BATCH, layout, None, False)
    assert config["train_batch_size"] == 2 * 2 * 2 * 2  # micro x accumulation x (dp x cp)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)


@pytest.mark.parametrize(
    "world, cp, tp, pp, words",
    [
        (6, 2, 2, 1, "world size 6 is not a multiple of context x tensor x pipeline parallel size 2 x 2 x 1 = 4"),
        (4, 0, 1, 1, "--context-parallel-size=0: must be a positive integer"),
        (
            4,
            2,
            1,
            1,
            "train_batch_size=6 is not divisible by train_micro_batch_size_per_gpu x data-parallel size = 2 x 2 "
            "(dp = world 4 / (cp 2 x tp 1 x pp 1))",
        ),
    ],
)
def test_layouts_the_world_cannot_hold_are_refused(world, cp, tp, pp, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        resolve_layout(world, tp, pp, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, cp)


@pytest.mark.parametrize(
    "seq, cp, tp, sp, words",
    [
        (
            30,
            4,
            1,
            False,
            "--seq-length 30: context parallelism splits each sequence into equal slices: seqlen = 30 is "
            "not divisible by CP 4",
        ),
        (36, 4, 2, True, "seqlen = 36 is not divisible by CP 4 x TP 2 (sequence parallelism) = 8"),
        (
            8,
            4,
            1,
            False,
            "--seq-length 8: context parallelism hands each rank's last d_conv - 1 = 3 tokens to the next "
            "rank: slices of seqlen 8 / CP 4 = 2 are shorter",
        ),
    ],
)
def test_sequences_context_parallelism_cannot_split_are_refused(seq, cp, tp, sp, words):
    layout = resolve_layout(cp * tp, tp, 1, BATCH, cp)
    with pytest.raises(LayoutError, match=re.escape(words)):
        check_run(layout, BATCH, TINY, seq, sp, None)


def test_the_context_parallel_flag_and_its_short_name_set_the_layout(tmp_path):
    ds_path, model_path = tmp_path / "ds.json", tmp_path / "model.json"
    ds_path.write_text(json.dumps(BATCH))
    model_path.write_text(json.dumps(TINY.to_dict()))
    script = load_train_script()
    base = ["--deepspeed_config", str(ds_path), "--model-config", str(model_path), "--train-iters", "10"]
    for flag in ("--context-parallel-size", "--cp"):
        plan = script.prepare(script.parse_args([*base, flag, "2", "--tp", "2"]), 8)
        assert (plan.layout.dp, plan.layout.cp, plan.layout.tp) == (2, 2, 2), flag


def test_the_script_exits_2_with_one_line_for_a_sequence_cp_cannot_split(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(TRAIN_PY),
            "--deepspeed_config",
            str(ROOT / "launch/configs/tiny-cpu.json"),
            "--model-config",
            str(ROOT / "launch/models/tiny-mamba2.json"),
            "--context-parallel-size",
            "4",
            "--seq-length",
            "30",
            "--train-iters",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"WORLD_SIZE": "4", "PATH": ""},
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == [
        "train.py: error: --seq-length 30: context parallelism splits each sequence into equal slices: "
        "seqlen = 30 is not divisible by CP 4"
    ], proc.stderr
