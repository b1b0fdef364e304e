"""The calibration's measurements: a kernel's backward is timed on its own, so noise in the forward's timing
cannot make its backward ratio vanish; link alpha-beta come from a least-squares fit."""
import time

import pytest
import torch

from megamamba.pipelines.planner.calibrate import _forward_backward, fit_link


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
