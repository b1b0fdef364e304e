"""launch/plan.py as a user runs it: --json prints one JSON object and nothing else; a wrong input is one
line on stderr and exit status 2."""

import json
import subprocess
import sys

from train_entry import ROOT

PLAN_PY = ROOT / "launch" / "plan.py"
MODEL = str(ROOT / "launch/models/mamba2-130m.json")


def _plan(*flags):
    return subprocess.run(
        [sys.executable, str(PLAN_PY), "--model-config", MODEL, "--seq-length", "2048", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_json_output_is_one_object_with_the_ranked_plans():
    run = _plan("--gpus", "8", "--global-batch-size", "64", "--top", "2", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert len(result["plans"]) == 2 and result["plans"][0]["train_flags"].startswith("--tensor-parallel-size")


def test_more_gpus_per_node_than_gpus_is_one_line_and_status_2():
    run = _plan("--gpus", "4", "--gpus-per-node", "8", "--global-batch-size", "64")
    assert run.returncode == 2 and run.stdout == ""
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("plan.py: error:")]
    assert "--gpus-per-node 8 is more than --gpus 4" in line
