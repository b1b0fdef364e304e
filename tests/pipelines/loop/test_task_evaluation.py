"""lm-eval tasks during training (`--eval-tasks`): global rank 0 evaluates each --eval-interval step's
checkpoint in a child process while training goes on, prints one line per result, and waits for the last
one before the run ends; settings that cannot run are refused at start-up."""

import argparse
import logging
import os
import subprocess
import sys

import pytest

from eval_tasks import held_out_task
from megamamba.pipelines.loop.task_evaluation import (
    TaskEvaluationError,
    TaskEvaluations,
    TaskSettings,
    add_task_evaluation_flags,
    task_settings,
)
from train_entry import ROOT, TRAIN_PY, rank_zero_of_one


def args_of(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-interval", type=int, default=1000)
    parser.add_argument("--eval-interval", type=int, default=0)
    add_task_evaluation_flags(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--eval-tasks", "held_out", "--eval-interval", "2"],
            "--eval-tasks evaluates the run's checkpoints: give --save DIR",
        ),
        (
            ["--eval-tasks", "held_out", "--save", "s", "--save-interval", "4", "--eval-interval", "6"],
            "--eval-interval 6 with --eval-tasks must be a positive multiple of --save-interval 4: each evaluation "
            "reads the checkpoint of its step",
        ),
        (
            [
                "--eval-tasks",
                "held_out",
                "--save",
                "s",
                "--save-interval",
                "2",
                "--eval-interval",
                "2",
                "--eval-tasks-limit",
                "0",
            ],
            "--eval-tasks-limit 0: must be at least 1",
        ),
    ],
)
def test_settings_that_cannot_run_are_refused_with_the_fix(argv, message):
    with pytest.raises(TaskEvaluationError) as refusal:
        task_settings(args_of(*argv))
    assert str(refusal.value) == message


@pytest.mark.slow  # lm-eval indexes its task folders: 7 s
def test_a_task_lm_eval_does_not_know_is_refused_at_start_up():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e .[eval]")
    argv = ["--eval-tasks", "no_such_task_xyz", "--save", "s", "--save-interval", "2", "--eval-interval", "2"]
    with pytest.raises(TaskEvaluationError, match=r"^--eval-tasks: --tasks: lm-eval knows no task no_such_task_xyz"):
        task_settings(args_of(*argv))


@pytest.mark.slow
def test_each_interval_checkpoint_is_evaluated_in_the_background_and_reported_in_one_line(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e .[eval]")
    tasks = held_out_task(tmp_path / "tasks", ("x = 1\n", "naïve café"), tmp_path / "datasets")
    save = tmp_path / "save"
    command = [
        sys.executable,
        str(TRAIN_PY),
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba2.json"),
        "--train-iters",
        "4",
        "--seq-length",
        "32",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--save",
        str(save),
        "--save-interval",
        "2",
        "--eval-tasks",
        "held_out",
        "--eval-tasks-include-path",
        str(tasks),
        "--eval-tasks-limit",
        "2",
    ]
    # rank 0 of 1 without the launcher; the children inherit all but the rendezvous variables
    env = {**os.environ, **rank_zero_of_one(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = sorted(os.listdir(save / "eval"))
    for tag in ("step_000002", "step_000004"):
        (line,) = [x for x in proc.stdout.splitlines() if f"evaluation of {tag}:" in x]
        written = [r for r in results if r.startswith(tag) and r.endswith(".json")]
        assert len([r for r in results if r.startswith(tag) and r.endswith(".log")]) == 1  # the child's output
        assert len(written) == 1 and line.startswith(f"train.py: evaluation of {tag}: held_out bits_per_byte,none")
        assert line.endswith(f"({save / 'eval' / written[0]})"), line


def test_an_evaluation_that_fails_is_one_warning_naming_its_error_and_its_log(tmp_path, caplog):
    settings = TaskSettings("held_out", None, None, "cpu")
    evaluations = TaskEvaluations(settings, str(tmp_path), rank=0)
    evaluations.start("step_000009")  # the save directory holds no such checkpoint
    with caplog.at_level(logging.INFO, logger="megamamba.pipelines.loop.task_evaluation"):
        evaluations.poll(wait=True)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (log_file,) = (tmp_path / "eval").glob("step_000009-*.log")
    assert warning.startswith("evaluation of step_000009 failed (exit 2): evaluate: error: --tag step_000009"), warning
    assert warning.endswith(f"; its log: {log_file}")
