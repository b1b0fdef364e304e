"""The shipped profiles: every number names its source; the H200's is built from what that GPU measured
(benchmarks/h200_profile.py) and reproduces the kernel times it was fitted to; the cost model reads a profile's
optimizer pass and its MFU peak."""

import dataclasses
import importlib.util
import json
import os

import pytest

from megamamba import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.pipelines.planner.profile import OptimizerPass, load_profile
from megamamba.pipelines.planner.step_time import kernel_seconds, optimizer_seconds
from train_entry import ROOT

PROFILES = os.path.join(ROOT, "launch", "profiles")
SECTIONS = ("kernels", "layers", "engine", "links", "collective_call_s", "optimizer")


def unsourced(data: dict) -> list:
    """The numbers of a profile's JSON with no source: a top-level number, or a section's entry, named neither
    by itself ("kernels.ssd") nor by its section ("kernels")."""
    sources = data.get("sources", {})
    missing = [
        k for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in sources
    ]
    for section in SECTIONS:
        if data.get(section) and section not in sources:
            entries = data[section] if section != "optimizer" else {"": data[section]}
            missing += [f"{section}.{name}" for name in entries if f"{section}.{name}" not in sources]
    return missing


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(os.listdir(PROFILES)))
def test_every_number_of_a_shipped_profile_names_its_source(name):
    with open(os.path.join(PROFILES, name)) as f:
        assert unsourced(json.load(f)) == []


@pytest.mark.parametrize("name", ["a100-80gb.json", "h100-80gb.json"])
def test_datasheet_profiles_say_they_are_unvalidated(name):
    profile = load_profile(os.path.join(PROFILES, name))
    assert profile.source.startswith("published:") and "unvalidated" in profile.source


def test_the_h200_profile_is_what_its_measurements_build(tmp_path):
    load_script("h200_profile").main(["--out", str(tmp_path / "h200.json")])
    assert (tmp_path / "h200.json").read_text() == open(os.path.join(PROFILES, "h200.json")).read()


@pytest.mark.parametrize("model, measured_ms", [("mamba2-130m", 0.492), ("mamba2-370m", 0.623), ("mamba2-1.3b", 1.168)])
def test_the_h200_profile_times_the_ssd_as_that_gpu_measured_it(model, measured_ms):
    """benchmarks/RESULTS.md 2026-12-04, 'Op timings': our SSD forward at 16K tokens of each layer shape."""
    profile = load_profile(os.path.join(PROFILES, "h200.json"))
    config = MambaConfig.from_json(os.path.join(ROOT, "launch", "models", f"{model}.json"))
    ssd = layer_type("mamba").work(RankShape(config, 8, 2048)).kernel("ssd")
    assert kernel_seconds("ssd", ssd.flops, ssd.bytes, profile) * 1e3 == pytest.approx(measured_ms, rel=0.1)


def test_a_profiles_optimizer_pass_sets_the_optimizers_time():
    profile = load_profile(os.path.join(PROFILES, "h200.json"))
    half = dataclasses.replace(profile, optimizer=OptimizerPass(32, profile.optimizer.efficiency / 2))
    assert optimizer_seconds(10**9, half) == pytest.approx(2 * optimizer_seconds(10**9, profile))
    assert optimizer_seconds(10**9, profile) == pytest.approx(32e9 / 4140e9 / profile.optimizer.efficiency)


def test_the_h200_mfu_is_against_the_datasheet_peak_not_the_measured_ceiling():
    profile = load_profile(os.path.join(PROFILES, "h200.json"))
    assert (profile.mfu_flops_per_s, profile.matmul_flops_per_s) == (989e12, 784e12)
