"""A (2,2,2) ZeRO-1 checkpoint resumes exactly at (2,2,2) and continues the loss curve at other layouts.

Uninterrupted: 8 steps at (2,2,2) on 8 spawned ranks, saving after step 4 (saving does not
perturb training: the uninterrupted curve is the one a run without --save trains). Resumed from
that checkpoint: at (2,2,2) bit-identically; at (1,1,4), (4,1,1) with ZeRO-1 and (1,2,1) without
ZeRO (the plain engine stepping torch AdamW) within 1e-4 relative of the uninterrupted curve
(reduction order differs between layouts, as in the 3D loss-curve tests). And the (1,1,1) ZeRO-0
reference checkpoint continues in a 2-stage pipeline without ZeRO.
"""

import pytest
import torch

from resume_runs import SAVE_AT, STEPS, losses

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def run222(resume_runs):
    save = resume_runs.new_dir() / "ckpt"
    run = resume_runs.spawned((2, 2, 2), 1, ["--save", str(save), "--save-interval", str(SAVE_AT)])
    assert [r["step"] for r in run["records"]] == list(range(STEPS))
    return {**run, "save": save}


def resumed(resume_runs, run222, layout, zero):
    load = ["--load", str(run222["save"] / f"step_{SAVE_AT:06d}")]
    run = resume_runs.spawned(layout, zero, load)
    assert [r["step"] for r in run["records"]] == list(range(SAVE_AT, STEPS))
    return losses(run["records"])


def test_2_2_2_resume_is_bit_identical(resume_runs, run222):
    assert resumed(resume_runs, run222, (2, 2, 2), 1) == losses(run222["records"])[SAVE_AT:]


@pytest.mark.parametrize(
    "layout, zero", [((1, 1, 4), 1), ((4, 1, 1), 1), ((1, 2, 1), 0)], ids=["1-1-4-zero1", "4-1-1-zero1", "1-2-1-zero0"]
)
def test_2_2_2_checkpoint_continues_the_curve_at_another_layout(resume_runs, run222, layout, zero):
    got = torch.tensor(resumed(resume_runs, run222, layout, zero), dtype=torch.float64)
    ref = torch.tensor(losses(run222["records"])[SAVE_AT:], dtype=torch.float64)
    assert torch.isfinite(got).all(), got
    error = ((got - ref).abs() / ref.abs()).max().item()
    print(f"(2,2,2) step {SAVE_AT} -> {layout} zero {zero}: max relative loss difference {error:.1e}")
    assert error <= TOLERANCE, (got, ref)


def test_single_rank_checkpoint_continues_the_curve_in_a_pipeline_without_zero(resume_runs, resume_reference):
    load = ["--load", str(resume_reference["dir"] / "ckpt" / f"step_{SAVE_AT:06d}")]
    run = resume_runs.spawned((1, 1, 2), 0, load)
    got = torch.tensor(losses(run["records"]), dtype=torch.float64)
    ref = torch.tensor(losses(resume_reference["records"])[SAVE_AT:], dtype=torch.float64)
    assert torch.isfinite(got).all() and len(got) == len(ref), got
    error = ((got - ref).abs() / ref.abs()).max().item()
    print(f"(1,1,1) zero 0 step {SAVE_AT} -> (1,1,2) zero 0: max relative loss difference {error:.1e}")
    assert error <= TOLERANCE, (got, ref)
