"""Faults through train.py: SIGTERM, a killed rank, kill -9 during a save, non-finite steps.

Measured here (2 cores): a rank SIGKILLed in training ends the launched job non-zero in ~1-2 s
(deepspeed's launch.py polls its ranks every second and terminates the rest); SIGTERM goes to the
job's process group, as a scheduler or a terminal sends it: the `deepspeed` runner dies at once
(DeepSpeed 0.19.8 forwards signals there only for multi-node pdsh), launch.py terminates the
ranks one at a time, and the flag all-reduce makes every rank stop after the same step.
"""

import os
import signal
import time

import psutil
import pytest

from megamamba.checkpoint import Checkpoint, find_latest
from resume_runs import STEPS, errors, losses
from train_entry import read_metrics

pytestmark = pytest.mark.slow


def records_of(out):
    return read_metrics(out / "metrics.jsonl")


def wait_for_steps(proc, out, n, timeout=240):
    deadline = time.monotonic() + timeout
    while len(records_of(out)) < n:
        assert proc.poll() is None, (out / "stdout.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the launched run logged no steps"
        time.sleep(0.1)


def run_processes(out):
    return [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]


def test_sigterm_to_the_launcher_stops_every_rank_after_one_step_with_a_checkpoint_that_resumes_exactly(resume_runs):
    reference = resume_runs.spawned((2, 1, 1), 1)["records"]
    out = resume_runs.new_dir()
    save = out / "ckpt"
    proc = resume_runs.launch(2, resume_runs.argv(out, (2, 1, 1), 1, ["--save", str(save)]), out)
    wait_for_steps(proc, out, 2)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler or a terminal does: the launchers and the ranks
    sent = time.monotonic()
    code = proc.wait(timeout=120)
    while run_processes(out):
        assert time.monotonic() - sent < 120, "ranks still running 120 s after SIGTERM"
        time.sleep(0.2)
    print(f"SIGTERM to the process group: runner exited {code}, every rank gone after {time.monotonic() - sent:.1f} s")
    stdout = (out / "stdout.txt").read_text()
    assert "Traceback" not in stdout, stdout[-3000:]
    stopped = records_of(out)[-1]["step"]
    assert 1 <= stopped < STEPS - 1, stdout[-3000:]
    assert f"train.py: SIGTERM: stopped after step {stopped} ({stopped + 1} steps done)" in stdout, stdout[-3000:]
    checkpoint = Checkpoint(find_latest(str(save)))
    assert checkpoint.step == stopped + 1
    assert losses(records_of(out)) == losses(reference)[: stopped + 1]
    resumed = resume_runs.spawned((2, 1, 1), 1, ["--load", "auto", "--save", str(save)])["records"]
    assert [r["step"] for r in resumed] == list(range(stopped + 1, STEPS))
    assert losses(resumed) == losses(reference)[stopped + 1 :]


def test_a_rank_killed_mid_training_ends_the_launched_job_non_zero_within_60_s(resume_runs):
    out = resume_runs.new_dir()
    proc = resume_runs.launch(2, resume_runs.argv(out, (2, 1, 1), 1, ["--train-iters", "400"]), out)
    wait_for_steps(proc, out, 2)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in " ".join(p.cmdline())]
    assert len(ranks) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
    ranks[0].kill()
    killed = time.monotonic()
    code = proc.wait(timeout=120)
    elapsed = time.monotonic() - killed
    print(f"rank 1 SIGKILLed: launcher exited {code} after {elapsed:.1f} s")
    assert code != 0 and elapsed < 60
    assert not run_processes(out)


# The file primitive (write, directory fsync, rename, delete) of the step-4 save at which the writer dies:
# 5: the tensor files written, not the JSON ones; 10: before the manifest; 16: the new checkpoint in place,
# before `latest`.
@pytest.mark.parametrize("at", [5, 10, 16])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_and_load_auto_resumes_from_it(
    resume_runs, resume_reference, at
):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    flags = ["--save", str(save), "--save-interval", "2"]
    killed = resume_runs.direct(resume_runs.argv(out, zero=0, flags=flags), out=out, faults={"kill_save": [4, at]})
    assert killed["returncode"] == -signal.SIGKILL, killed["stderr"][-3000:]
    assert Checkpoint(find_latest(str(save))).step == 2
    out2 = resume_runs.new_dir()
    run = resume_runs.direct(resume_runs.argv(out2, zero=0, flags=["--load", "auto", *flags]), out=out2)
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(2, STEPS))
    assert losses(run["records"]) == losses(resume_reference["records"])[2:]
    assert Checkpoint(find_latest(str(save))).step == STEPS


@pytest.mark.parametrize("zero", [0, 1])
def test_a_non_finite_step_is_skipped_with_a_warning_and_training_goes_on(resume_runs, zero):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    run = resume_runs.direct(
        resume_runs.argv(out, zero=zero, flags=["--train-iters", "4", "--save", str(save), "--save-interval", "1"]),
        out=out,
        faults={"nan_steps": [2]},
    )
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert "train.py: warning: step 2: non-finite loss or gradients" in run["stdout"], run["stdout"][-2000:]
    assert all(r["loss"] == r["loss"] for r in run["records"])
    assert sorted(os.listdir(save)) == ["latest", "step_000001", "step_000002", "step_000004"]  # none while skipping
    weights = [Checkpoint(str(save / f"step_{s:06d}")).model_tensors() for s in (2, 4)]
    moments = Checkpoint(str(save / "step_000004")).optimizer_tensors()
    assert {t.item() for k, t in moments.items() if k.endswith("/step")} == {3.0}, "the skipped step updated Adam"
    assert any((weights[0][k] != weights[1][k]).any() for k in weights[0]), "the step after did not train"


def test_too_many_non_finite_steps_in_a_row_abort_with_one_message(resume_runs):
    out = resume_runs.new_dir()
    run = resume_runs.direct(
        resume_runs.argv(out, zero=0, flags=["--max-skipped-steps", "2"]), out=out, faults={"nan_steps": [1, 2]}
    )
    assert run["returncode"] == 1
    assert errors(run["stderr"]) == [
        "train.py: error: 2 steps in a row up to step 2 had non-finite loss or "
        "gradients or a loss spike; lower the learning rate and resume from step 0 "
        "(no checkpoint was written before the trouble)"
    ]
