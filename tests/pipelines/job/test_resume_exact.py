"""Resume is exact: 8 steps uninterrupted vs 4 steps, a checkpoint, a fresh process resuming 4 more.

(1,1,1) without ZeRO (torch AdamW stepped by the engine) here; (2,2,2) with ZeRO-1 in
test_resume_layouts.py. The last four losses must be bit-identical in float32.
"""

import pytest

from resume_runs import SAVE_AT, STEPS, losses

pytestmark = pytest.mark.slow


def test_single_rank_resume_continues_the_loss_curve_bit_identically(resume_runs, resume_reference):
    out = resume_runs.new_dir()
    checkpoint = resume_reference["dir"] / "ckpt" / f"step_{SAVE_AT:06d}"
    run = resume_runs.direct(resume_runs.argv(out, zero=0, flags=["--load", str(checkpoint)]), out=out)
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(SAVE_AT, STEPS))
    assert losses(run["records"]) == losses(resume_reference["records"])[SAVE_AT:], (
        run["records"],
        resume_reference["records"],
    )


def test_the_reference_saved_at_the_interval_and_at_the_end(resume_reference):
    from megamamba.checkpoint import Checkpoint, find_latest

    ckpt = resume_reference["dir"] / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step_{SAVE_AT:06d}", f"step_{STEPS:06d}"]
    latest = Checkpoint(find_latest(str(ckpt)))
    assert latest.step == STEPS and latest.extra["layout"] == {"dp": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def test_keep_last_keeps_only_the_newest_checkpoints(resume_runs):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    run = resume_runs.direct(
        resume_runs.argv(
            out, zero=0, flags=["--train-iters", "4", "--save", str(save), "--save-interval", "1", "--keep-last", "2"]
        ),
        out=out,
    )
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_000003", "step_000004"]


def test_save_and_load_on_the_same_empty_directory_start_afresh_then_resume(resume_runs, resume_reference):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    flags = ["--save", str(save), "--load", str(save), "--save-interval", str(SAVE_AT)]
    first = resume_runs.direct(
        resume_runs.argv(out, zero=0, flags=[*flags, "--train-iters", str(SAVE_AT), "--lr-decay-iters", str(STEPS)]),
        out=out,
    )
    assert first["returncode"] == 0, first["stderr"][-3000:]
    assert (
        f"train.py: warning: --load {save} is the --save directory and holds no checkpoint yet; starting from step 0"
    ) in first["stdout"]
    again = resume_runs.direct(resume_runs.argv(out, zero=0, flags=flags), out=out)
    assert again["returncode"] == 0, again["stderr"][-3000:]
    assert losses(again["records"]) == losses(resume_reference["records"]), "the curve of an uninterrupted run"
