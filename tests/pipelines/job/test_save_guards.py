"""What keeps a save directory's past safe, through train.py: one job writes it (a second is refused
at start-up, naming the holder), and a run that goes bad neither writes nor prunes checkpoints while
its steps are being skipped, and keeps the newest checkpoint from before the trouble."""

import os
import signal
import time

import pytest

from megamamba.checkpoint import Checkpoint, find_latest
from megamamba.checkpoint.lock import LOCK_FILE
from resume_runs import errors, snapshot
from train_entry import read_metrics

pytestmark = pytest.mark.slow


def checkpoints(save) -> list:
    return sorted(n for n in os.listdir(save) if n.startswith("step_"))


def test_a_second_trainer_on_the_same_save_directory_is_refused_and_the_first_is_untouched(resume_runs):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    argv = resume_runs.argv(out, zero=0, flags=["--train-iters", "400", "--save", str(save), "--save-interval", "2"])
    first = resume_runs.direct_background(argv, out)
    try:
        deadline = time.monotonic() + 240
        while len(read_metrics(out / "metrics.jsonl")) < 3:
            assert first.poll() is None and time.monotonic() < deadline, (out / "stderr.txt").read_text()[-3000:]
            time.sleep(0.2)
        before = snapshot(save / "step_000002")
        out2 = resume_runs.new_dir()
        second = resume_runs.direct(
            resume_runs.argv(out2, zero=0, flags=["--save", str(save), "--save-interval", "1", "--load", "auto"]),
            out=out2,
        )
        assert first.poll() is None, "the first run ended before the second was refused: lengthen it"
    finally:
        first.send_signal(signal.SIGTERM)  # stops after its current step and saves
    assert first.wait(timeout=120) == 0, (out / "stderr.txt").read_text()[-3000:]
    assert second["returncode"] == 2, second["stderr"][-3000:]
    (line,) = errors(second["stderr"])
    assert f"--save {save} is in use by another job: pid {first.pid} on host {os.uname().nodename}" in line, line
    assert second["records"] == [] and "| loss " not in second["stdout"]
    assert snapshot(save / "step_000002") == before
    tags = checkpoints(save)
    for tag in tags:  # every size and sha256 against its manifest, and written by the first job
        checkpoint = Checkpoint(str(save / tag), hashes=True)
        assert checkpoint.extra["args"]["metrics_jsonl"] == str(out / "metrics.jsonl")
    stopped = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert find_latest(str(save)) == str(save / f"step_{stopped + 1:06d}") == str(save / tags[-1])
    assert sorted(set(os.listdir(save)) - set(tags)) == ["latest"], os.listdir(save)  # lock released, no leftovers
    assert not (save / LOCK_FILE).exists()


def test_a_blow_up_writes_and_prunes_nothing_and_the_good_checkpoint_survives_keep_last_1(resume_runs):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    flags = ["--save", str(save), "--save-interval", "1", "--keep-last", "1", "--max-skipped-steps", "3"]
    run = resume_runs.direct(resume_runs.argv(out, zero=0, flags=flags), out=out, faults={"nan_steps": [4, 5, 6]})
    assert run["returncode"] == 1, run["stderr"][-3000:]
    good = save / "step_000004"
    assert errors(run["stderr"]) == [
        "train.py: error: 3 steps in a row up to step 6 had non-finite loss or gradients or a loss spike; lower the "
        f"learning rate and resume from {good}"
    ]
    for step, in_a_row in ((4, 1), (5, 2)):
        assert (
            f"train.py: warning: step {step}: no checkpoint written and none pruned while steps are being skipped "
            f"({in_a_row} in a row); the newest stays {good}"
        ) in run["stdout"], run["stdout"][-3000:]
    assert checkpoints(save) == ["step_000004"]
    assert find_latest(str(save)) == str(good) and Checkpoint(str(good), hashes=True).step == 4


def test_after_a_recovered_blow_up_keep_last_still_keeps_the_checkpoint_from_before_it(resume_runs):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    flags = ["--save", str(save), "--save-interval", "1", "--keep-last", "1"]
    run = resume_runs.direct(resume_runs.argv(out, zero=0, flags=flags), out=out, faults={"nan_steps": [2]})
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert checkpoints(save) == ["step_000002", "step_000008"]
    assert find_latest(str(save)) == str(save / "step_000008")
