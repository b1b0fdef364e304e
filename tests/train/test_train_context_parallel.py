"""Context parallelism through the real `deepspeed` launcher trains the single-rank loss curve.

Every layout below runs 5 steps (float32, gloo, the 3-layer tiny models of tests/train/conftest.py)
and its loss and gradient-norm curves are compared with the (1,1,1,1) run of the same mixer: the
batches are the same (each CP rank keeps its slice of its replica's sequences) and the averaged
gradients are the single-device ones, so only reduction order differs. The (1,2,1,1) run saves
after step 3 and that checkpoint continues the reference curve at CP 1 on one rank.
"""
import json

import pytest

from conftest import losses, relative_curve_error

pytestmark = pytest.mark.slow

SAVE_AT = 3
LAYOUTS = {  # name: (mixer, world, flags); layouts as (dp, cp, tp, pp)
    "mamba2-1-2-1-1": ("mamba2", 2, ["--cp", "2", "--save", "ckpt", "--save-interval", str(SAVE_AT)]),
    "mamba2-1-2-2-1": ("mamba2", 4, ["--cp", "2", "--tp", "2"]),
    "mamba2-1-2-1-2": ("mamba2", 4, ["--context-parallel-size", "2", "--pp", "2"]),
    "mamba2-2-2-1-2": ("mamba2", 8, ["--cp", "2", "--pp", "2"]),
    "mamba1-1-2-2-1-sp": ("mamba1", 4, ["--cp", "2", "--tp", "2", "--sequence-parallel"]),
}


def _launched(runs, name):
    mixer, world, flags = LAYOUTS[name]
    run = runs.launched(world, mixer, flags)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_trains_the_single_rank_loss_curve(runs, reference, name):
    run = _launched(runs, name)
    ref = reference(LAYOUTS[name][0])["records"]
    error = relative_curve_error(losses(run["records"]), losses(ref))
    print(f"{name} (launcher): max relative loss difference to (1,1,1,1) {error:.1e}")
    assert error <= 1e-4, (losses(run["records"]), losses(ref))
    assert relative_curve_error(losses(run["records"], "grad_norm"), losses(ref, "grad_norm")) <= 1e-4
    assert relative_curve_error(losses(run["records"], "val_loss"), losses(ref, "val_loss")) <= 1e-4


def test_the_console_names_the_context_parallel_size(runs):
    run = _launched(runs, "mamba2-2-2-1-2")
    assert "layout: world 8 = dp 2 x cp 2 x tp 1 x pp 2 | micro batch 2 x grad accumulation 2 x dp 2 = global " \
           "batch 8" in run["stdout"]


def test_a_context_parallel_checkpoint_records_cp_and_continues_the_curve_at_cp_1(runs, reference):
    saved = _launched(runs, "mamba2-1-2-1-1")["dir"] / "ckpt" / f"step_{SAVE_AT:06d}"
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["extra"]["layout"] == {"dp": 1, "cp": 2, "tp": 1, "pp": 1}
    run = runs.launched(1, "mamba2", ["--load", str(saved)])
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(SAVE_AT, 5))
    ref = reference("mamba2")["records"][SAVE_AT:]
    error = relative_curve_error(losses(run["records"]), losses(ref))
    print(f"CP 2 step {SAVE_AT} -> CP 1: max relative loss difference {error:.1e}")
    assert error <= 1e-4, (losses(run["records"]), losses(ref))
