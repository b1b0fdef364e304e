"""--auto-parallel's start-up choice: what the user set stays fixed, the rest is the planner's fastest plan,
and train.py knows which flags were given."""

import json
import os

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.planner.for_run import choose, default_profile
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import PlanError
from train_entry import ROOT, load_train_script

H100 = load_profile(str(ROOT / "launch/profiles/h100-80gb.json"))
MODEL = MambaConfig.from_json(ROOT / "launch/models/mamba2-130m.json")
GiB = 2**30


def test_flags_given_on_the_command_line_are_told_from_defaults():
    given = load_train_script().given_flags(
        ["--deepspeed_config", "x.json", "--model-config", "m.json", "--tp", "1", "--auto-parallel"]
    )
    assert given == {"deepspeed_config", "model_config", "tensor_parallel_size", "auto_parallel"}


def test_a_given_tensor_parallel_size_and_the_jsons_zero_stage_stay_fixed():
    choice = choose(
        MODEL, {"train_batch_size": 64, "zero_optimization": {"stage": 1}}, {"tp": 2}, 8, 8, 40 * GiB, 2048, H100
    )
    assert (choice.best.tp, choice.best.zero_stage) == (2, 1)
    assert choice.runner_up is not None and choice.runner_up.time.total >= choice.best.time.total


def test_the_choice_is_the_searchs_fastest_plan():
    free = choose(MODEL, {"train_batch_size": 64}, {}, 8, 8, 40 * GiB, 2048, H100)
    fixed = choose(
        MODEL, {"train_batch_size": 64}, {"tp": free.best.tp, "pp": free.best.pp}, 8, 8, 40 * GiB, 2048, H100
    )
    assert fixed.best == free.best


def test_without_a_global_batch_the_planner_says_where_to_set_it():
    with pytest.raises(PlanError, match="set train_batch_size in the DeepSpeed config or --global-batch-size"):
        choose(MODEL, {"train_micro_batch_size_per_gpu": 2}, {}, 8, 8, 40 * GiB, 2048, H100)


def test_a_gpu_without_a_shipped_profile_is_told_how_to_measure_one():
    with pytest.raises(PlanError, match="python launch/plan.py --calibrate"):
        default_profile(str(ROOT / "launch/profiles"), "NVIDIA L4")
    assert default_profile("p", "NVIDIA H100 80GB HBM3") == os.path.join("p", "h100-80gb.json")
    assert json.loads((ROOT / "launch/profiles/h200.json").read_text())["name"].startswith("H200")
