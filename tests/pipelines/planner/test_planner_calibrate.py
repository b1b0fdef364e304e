"""The calibration's measurements: a kernel's backward is timed on its own, so noise in the forward's timing
cannot make its backward ratio vanish; a kernel's fixed cost and efficiency, and a link's alpha-beta, come from
fits, and so does a layer's fixed cost and scale over what its kernels predict."""

import json
import os
import time

import pytest
import torch

from megamamba import MambaConfig
from megamamba.pipelines.planner import calibrate as calibration
from megamamba.pipelines.planner.calibrate import _forward_backward, fit_kernel, fit_line, fit_link
from megamamba.pipelines.planner.profile import load_profile
from test_planner_profiles import unsourced
from train_entry import ROOT


class _Sleeps(torch.autograd.Function):
    """20 ms forward, 5 ms backward: wall times a loaded machine can only lengthen."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.005)
        return grad * 2


def test_a_kernels_backward_is_timed_without_its_forward():
    forward, backward = _forward_backward(_Sleeps.apply, [torch.ones(3)], torch.device("cpu"))
    assert forward >= 0.02
    assert 0.005 <= backward < 0.015, (forward, backward)


def test_a_link_fit_recovers_alpha_and_bandwidth():
    samples = [(b, 1e-5 + b / 2e9) for b in (1e3, 1e5, 1e6, 4e6)]
    link = fit_link(samples)
    assert (link.alpha_s, link.bytes_per_s) == (pytest.approx(1e-5), pytest.approx(2e9))


def test_a_kernels_fixed_cost_and_efficiency_come_from_two_sizes():
    efficiency, fixed = fit_kernel((1e-3, 5e-3 + 1e-3 / 0.25), (4e-3, 5e-3 + 4e-3 / 0.25))
    assert (efficiency, fixed) == (pytest.approx(0.25), pytest.approx(5e-3))


def test_a_kernel_whose_larger_size_is_not_slower_is_all_fixed_cost():
    assert fit_kernel((1e-6, 2e-3), (4e-6, 1.9e-3)) == (1.0, pytest.approx(2e-3 - 1e-6))


def test_a_layers_fixed_cost_and_scale_over_its_kernels_come_from_two_sizes():
    assert fit_line((1e-3, 4e-3 + 1.5e-3), (4e-3, 4e-3 + 6e-3)) == (pytest.approx(4e-3), pytest.approx(1.5))


def test_a_layer_whose_larger_size_is_not_slower_keeps_its_kernels_and_the_rest_as_fixed_cost():
    assert fit_line((1e-4, 2e-3), (4e-4, 1.9e-3)) == (pytest.approx(2e-3 - 1e-4), 1.0)


def test_a_calibrated_profile_writes_the_h200_profiles_fields_each_with_its_source(tmp_path, monkeypatch):
    """The kernels, optimizer pass and layer fits measured on this CPU at the tiny Mamba-2's shapes (the
    whole-step costs, which build trainers, are left out: 2 s instead of a minute)."""
    monkeypatch.setattr(calibration, "one_rank_costs", lambda model, batch, seqlen, profile: profile)
    model = MambaConfig.from_json(os.path.join(ROOT, "launch/models/tiny-mamba2.json"))
    links = load_profile(os.path.join(ROOT, "launch/profiles/h200.json")).links
    calibration.calibrate(model, 32, 1, torch.device("cpu"), links, "the H200's", False).to_json(tmp_path / "p.json")
    written = json.loads((tmp_path / "p.json").read_text())
    shipped = json.loads(open(os.path.join(ROOT, "launch/profiles/h200.json")).read())
    assert set(shipped) <= set(written)
    assert 0 < written["optimizer"]["efficiency"] <= 1 and written["optimizer"]["bytes_per_parameter"] == 32
    assert unsourced(written) == []
