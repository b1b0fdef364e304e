"""The learning-rate schedule: warm-up, then cosine / linear / constant decay to the minimum."""

import math

import pytest
import torch

from megamamba.schedule.lr_schedule import LRSchedule


def test_warmup_rises_linearly_to_the_peak():
    s = LRSchedule(peak=1.0, minimum=0.1, warmup_iters=4, total_iters=20)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_starts_at_the_peak_and_ends_at_the_minimum(style):
    s = LRSchedule(peak=1.0, minimum=0.1, warmup_iters=2, total_iters=12, decay_style=style)
    assert s(2) == pytest.approx(1.0)
    assert s(12) == pytest.approx(0.1)
    assert s(1000) == pytest.approx(0.1)
    values = [s(i) for i in range(2, 13)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_midpoint_is_halfway_and_linear_is_proportional():
    cosine = LRSchedule(peak=1.0, minimum=0.0, warmup_iters=0, total_iters=10, decay_style="cosine")
    linear = LRSchedule(peak=1.0, minimum=0.0, warmup_iters=0, total_iters=10, decay_style="linear")
    assert cosine(5) == pytest.approx(0.5)
    assert cosine(2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert linear(3) == pytest.approx(0.7)


def test_constant_stays_at_the_peak_after_warmup():
    s = LRSchedule(peak=2e-3, minimum=0.0, warmup_iters=3, total_iters=10, decay_style="constant")
    assert [s(i) for i in range(3, 10)] == [2e-3] * 7


def test_scheduler_sets_every_group_to_the_schedule_step_by_step():
    s = LRSchedule(peak=0.5, minimum=0.05, warmup_iters=2, total_iters=6)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}], lr=0.5
    )
    sched = s.scheduler(opt)
    for step in range(6):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([s(step)] * 2), step
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(peak=0.0, minimum=0.0, warmup_iters=0, total_iters=1), "peak lr"),
        (dict(peak=1.0, minimum=2.0, warmup_iters=0, total_iters=1), "min lr"),
        (dict(peak=1.0, minimum=0.0, warmup_iters=5, total_iters=4), "warm-up"),
        (dict(peak=1.0, minimum=0.0, warmup_iters=0, total_iters=4, decay_style="exp"), "decay style"),
    ],
)
def test_invalid_settings_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LRSchedule(**kwargs)


@pytest.mark.slow
def test_the_logged_lr_is_the_optimizers_and_a_skipped_step_does_not_advance_it(train_runs):
    (summary,) = train_runs.spawned(
        1, "mamba2", ["--lr-warmup-iters", "4", "--log-interval", "1"], faults={"nan_steps": [2]}
    )
    s = LRSchedule(peak=1e-3, minimum=1e-4, warmup_iters=4, total_iters=5)
    assert [r["lr"] for r in summary["records"]] == pytest.approx([s(0), s(1), s(2), s(2), s(3)], rel=1e-12)
