"""Resuming the (1,1,1) reference checkpoint of step 4 with changed flags, through launch/train.py.

A change of the sample stream or of the LR plan is refused at start-up: exit 2, one line naming
the difference and its override flag. The overrides accept them. --no-load-optim continues the
step count from the checkpoint's weights with a fresh optimizer and LR schedule.
"""

import pytest

from megamamba.checkpoint import Checkpoint
from megamamba.schedule.lr_schedule import LRSchedule
from resume_runs import SAVE_AT, STEPS, errors

pytestmark = pytest.mark.slow


def _resume(resume_runs, resume_reference, flags, zero: int = 0) -> dict:
    out = resume_runs.new_dir()
    checkpoint = resume_reference["dir"] / "ckpt" / f"step_{SAVE_AT:06d}"
    run = resume_runs.direct(resume_runs.argv(out, zero=zero, flags=["--load", str(checkpoint), *flags]), out=out)
    resumed = [line for line in run["stdout"].splitlines() if line.startswith("train.py: resumed from")]
    return {**run, "checkpoint": checkpoint, "resumed": resumed}


@pytest.mark.parametrize(
    "flags, named, override",
    [
        (["--seq-length", "64"], "--seq-length: checkpoint 32, run 64", "--override-data-check"),
        (["--lr", "2e-3"], "peak: checkpoint 0.001, run 0.002", "--override-opt_param-scheduler"),
    ],
    ids=["seq-length", "lr"],
)
def test_a_change_the_run_cannot_honour_is_refused_with_one_line_naming_it_and_the_override(
    resume_runs, resume_reference, flags, named, override
):
    run = _resume(resume_runs, resume_reference, flags)
    assert run["returncode"] == 2, run["stderr"][-3000:]
    lines = errors(run["stderr"])
    assert len(set(lines)) == 1 and named in lines[0] and override in lines[0], run["stderr"][-3000:]
    assert str(run["checkpoint"]) in lines[0] and run["records"] == []


def test_the_overrides_continue_with_the_new_sequence_length_and_lr_plan(resume_runs, resume_reference):
    run = _resume(
        resume_runs,
        resume_reference,
        ["--seq-length", "64", "--override-data-check", "--lr", "2e-3", "--override-opt_param-scheduler"],
    )
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(SAVE_AT, STEPS))
    assert run["records"][0]["lr"] == LRSchedule(2e-3, 1e-4, 1, STEPS)(SAVE_AT)
    (line,) = run["resumed"]
    assert "overridden (--override-data-check): --seq-length: checkpoint 32, run 64" in line
    assert "LR plan overridden (--override-opt_param-scheduler): peak: checkpoint 0.001, run 0.002" in line


@pytest.mark.parametrize("zero", [0, 1], ids=["torch-adamw", "zero1"])
def test_no_load_optim_continues_the_steps_from_the_weights_with_a_fresh_optimizer_and_schedule(
    resume_runs, resume_reference, zero
):
    save = resume_runs.new_dir() / "ckpt"
    run = _resume(
        resume_runs,
        resume_reference,
        ["--no-load-optim", "--no-load-rng", "--train-iters", str(SAVE_AT + 1), "--save", str(save)],
        zero,
    )
    assert run["returncode"] == 0, run["stderr"][-3000:]
    (record,) = run["records"]
    assert record["step"] == SAVE_AT
    assert record["loss"] == resume_reference["records"][SAVE_AT]["loss"]  # the same weights
    assert record["lr"] == LRSchedule(1e-3, 1e-4, 1, SAVE_AT + 1)(0)  # the schedule's first step
    assert run["resumed"] == [
        f"train.py: resumed from {run['checkpoint']}: next step {SAVE_AT} of {SAVE_AT + 1}, "
        f"next sample {SAVE_AT * 8} (fresh optimizer state and LR schedule (--no-load-optim); "
        "RNG states not restored (--no-load-rng))"
    ]
    steps = {
        t.item()
        for k, t in Checkpoint(str(save / f"step_{SAVE_AT + 1:06d}")).optimizer_tensors().items()
        if k.endswith("/step")
    }
    assert steps == {1.0}, steps  # one AdamW step since the fresh start, not SAVE_AT + 1
