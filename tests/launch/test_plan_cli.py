"""launch/plan.py as a user runs it: --json prints one JSON object and nothing else; a wrong input is one
line on stderr and exit status 2."""

import importlib.util
import json
import subprocess
import sys

import pytest

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


def _plan_script():
    spec = importlib.util.spec_from_file_location("megamamba_plan_script", PLAN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("given, gib", [("80", "80.0"), ("141GiB", "141.0"), ("80GB", "74.5"), ("40960 MiB", "40.0")])
def test_gpu_memory_takes_units_and_a_bare_number_is_gib(capsys, given, gib):
    flags = ["--model-config", MODEL, "--seq-length", "2048", "--gpus", "8", "--global-batch-size", "64"]
    _plan_script().main([*flags, "--top", "1", "--gpu-memory", given])
    assert f"(8 per node, {gib} GiB each)" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["abc", "0", "-3", "inf"])
def test_a_gpu_memory_that_is_no_size_is_refused_naming_the_flag(capsys, given):
    with pytest.raises(SystemExit) as exit_info:
        _plan_script().main(["--model-config", MODEL, "--seq-length", "2048", "--gpu-memory", given])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    rule = "give the memory per GPU as e.g. 80 (GiB), 80GiB or 80GB"
    assert line.endswith(f"error: argument --gpu-memory: {given!r}: {rule}"), line  # after the program's name
