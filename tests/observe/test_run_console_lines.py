"""A training run's console, as a log file sees it: the start-up summary, `step N/TOTAL` with elapsed
time and ETA on every logged step, one line per save and per resume, no carriage return."""

import re

import pytest

from resume_runs import SAVE_AT, STEPS

pytestmark = pytest.mark.slow

STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss .* \| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$")


def _step_lines(stdout: str) -> list:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def test_summary_steps_and_saves_are_printed_once_by_rank_0(resume_reference):
    out = resume_reference["stdout"]
    summary = out[out.index("run: Mamba2, 4 layers") :].splitlines()[:9]
    assert "per rank (this stage / TP shard)" in summary[0]
    expected = [
        "global batch 8 x seq 32 = 256 tokens per step",
        f"{STEPS} steps = {STEPS * 256} tokens",
        "data: <built-in corpus> train weight 1 |",
        "train.py: warning: no --data",
        "lr: peak 0.001, min 0.0001, warm-up 1 iters, cosine decay over 8 iters",
        "precision: float32 | ZeRO stage 0",
        f"every {SAVE_AT} steps",
    ]
    for text in expected:
        assert sum(text in line for line in summary) == 1, (text, summary)
    assert out.count("optimizer state, every rank:") == 1 and out.count("optimizer state bytes") == 1  # no ZeRO
    steps = _step_lines(out)
    assert [STEP_LINE.match(line).groups() for line in steps] == [(str(s), str(STEPS)) for s in range(STEPS)], steps
    saves = re.findall(r"^train\.py: saved (\S+) after step (\d+) \((\d+) steps done\) in [\d.]+ s$", out, re.M)
    assert [(step, done) for _, step, done in saves] == [("3", "4"), ("7", "8")], out[-3000:]
    assert all(r["eta_s"] >= 0 and r["elapsed_s"] > 0 for r in resume_reference["records"])
    assert resume_reference["records"][-1]["eta_s"] == 0
    assert "\r" not in out + resume_reference["stderr"]


def test_a_resumed_run_says_where_it_resumes_and_counts_to_the_same_total(resume_runs, resume_reference):
    checkpoint = resume_reference["dir"] / "ckpt" / f"step_{SAVE_AT:06d}"
    out_dir = resume_runs.new_dir()
    run = resume_runs.direct(resume_runs.argv(out_dir, zero=0, flags=["--load", str(checkpoint)]), out=out_dir)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    resumed = [line for line in run["stdout"].splitlines() if line.startswith("train.py: resumed from")]
    assert resumed == [
        f"train.py: resumed from {checkpoint}: next step {SAVE_AT} of {STEPS}, next sample {SAVE_AT * 8}"
    ], run["stdout"][-3000:]
    assert f"--load {checkpoint}" in run["stdout"]
    steps = [STEP_LINE.match(line).groups() for line in _step_lines(run["stdout"])]
    assert steps == [(str(s), str(STEPS)) for s in range(SAVE_AT, STEPS)]
    assert "\r" not in run["stdout"] + run["stderr"]
