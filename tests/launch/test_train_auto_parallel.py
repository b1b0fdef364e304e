"""`deepspeed launch/train.py --auto-parallel`: the planner chooses the layout at start-up (this machine's
measured profile, launch/profiles/cpu.json), says what it chose and its runner-up, and the run it starts
trains the same loss curve as one rank (every layout computes the same model)."""

import re

import pytest

from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow


def test_auto_parallel_says_its_choice_and_trains_the_single_rank_curve(train_runs, packed_documents):
    run = train_runs.launched(2, "hybrid", [*packed_documents, "--auto-parallel"])
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    chosen = re.search(
        r"train\.py: auto-parallel \(CPU.*\): dp (\d) x cp (\d) x tp (\d) x pp (\d), ZeRO 1, "
        r"micro batch 2",
        run["stdout"],
    )  # tiny-cpu.json's micro batch and ZeRO stage stay
    assert chosen and "runner-up: dp" in run["stdout"], run["stdout"][:3000]
    dp, cp, tp, pp = chosen.groups()
    assert f"layout: world 2 = dp {dp}" in run["stdout"] and f"tp {tp} x pp {pp}" in run["stdout"]
    reference = train_runs.launched(1, "hybrid", packed_documents)
    assert reference["returncode"] == 0, reference["stdout"][-3000:]
    error = relative_curve_error(losses(run["records"]), losses(reference["records"]))
    assert error <= 1e-4, (losses(run["records"]), losses(reference["records"]))
