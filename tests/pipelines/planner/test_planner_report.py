"""The planner's answer as a user reads it: the table ends with where the best plan's time goes and how to
run it, and --json holds the same plans with train.py's flags and the DeepSpeed keys."""

import dataclasses
import json
import os

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.report import TIME_PARTS, search_dict, search_lines
from megamamba.pipelines.planner.search import Request, search
from train_entry import ROOT


@pytest.fixture(scope="module")
def result():
    model = MambaConfig.from_json(os.path.join(ROOT, "launch/models/mamba2-130m.json"))
    return search(
        Request(model, 8, 8, 2048, 64, 16 * 2**30), load_profile(os.path.join(ROOT, "launch/profiles/h100-80gb.json"))
    )


def test_the_table_shows_every_part_of_the_best_step_and_how_to_run_it(result):
    best, lines = result.plans[0], search_lines(result, 3)
    step = next(line for line in lines if line.startswith("best plan's step:"))
    assert all(part.replace("_", " ") in step for part in TIME_PARTS)
    run = next(line for line in lines if line.startswith("run it:"))
    assert f"--tensor-parallel-size {best.tp} --pipeline-parallel-size {best.pp}" in run
    assert json.loads(run.split("DeepSpeed JSON ", 1)[1]) == {
        "train_micro_batch_size_per_gpu": best.micro_batch_size,
        "gradient_accumulation_steps": best.grad_accum,
        "zero_optimization": {"stage": best.zero_stage},
    }


def test_json_lists_the_top_plans_with_their_flags_and_every_rejected_family(result):
    out = json.loads(json.dumps(search_dict(result, 3)))
    assert [(p["dp"], p["tp"], p["pp"], p["zero_stage"]) for p in out["plans"]] == [
        (p.dp, p.tp, p.pp, p.zero_stage) for p in result.plans[:3]
    ]
    assert out["plans"][0]["train_flags"].startswith(f"--tensor-parallel-size {result.plans[0].tp} ")
    assert len(out["rejected"]) == len(result.rejected)


def test_an_mfu_beyond_the_best_measured_plus_the_margin_is_marked_an_extrapolation(result):
    """The H100 profile has no measured run (no mark); given one whose best MFU the top plan exceeds by more than
    5 points, its row is starred and a line says why."""
    assert not any("extrapolation" in line for line in search_lines(result, 3))
    below = dataclasses.replace(result, measured_mfu=result.plans[0].mfu - 0.06)
    lines = search_lines(below, 1)
    assert next(line for line in lines if line.startswith("  1 ")).endswith("%*")
    assert (
        f"* MFU above the best measured on this GPU ({100 * below.measured_mfu:.1f}%) plus 5 points: an "
        "extrapolation beyond the profile's measured runs"
    ) in lines
    assert search_dict(below, 1)["plans"][0]["mfu_extrapolated"] is True
