"""Hybrid models and context parallelism through the real `deepspeed` launcher train the single-rank curve.

Every layout below runs 5 steps (float32, gloo, the 3-layer tiny models of tests/train_runs.py)
and its loss, gradient-norm and validation-loss curves are compared with the (1,1,1,1) run of the
same model: the batches are the same (each CP rank keeps its slice of its replica's sequences) and
the averaged gradients are the single-device ones, so only reduction order differs. The hybrid
("M*-": Mamba-2, attention with 4 query heads sharing one key/value head and rotary on half of each
head, gated MLP) trains on packed short documents, so Mamba-2's state passing and attention's
document mask both cross CP slices; TP 2 replicates its key/value head. One layout recomputes
activations, one runs ZeRO-2. The (1,1,2,2) run saves after step 3 and that checkpoint continues the
reference curve at (2,1,1,1) with ZeRO-2.
"""

import json

import pytest

from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow

SAVE_AT = 3
ZERO_2 = {"zero_optimization": {"stage": 2}}
LAYOUTS = {  # name: (mixer, world, flags, DeepSpeed config changes); layouts as (dp, cp, tp, pp)
    "hybrid-2-1-1-1-zero2": ("hybrid", 2, [], ZERO_2),
    "hybrid-1-1-2-2": ("hybrid", 4, ["--tp", "2", "--pp", "2", "--save", "ckpt", "--save-interval", str(SAVE_AT)], {}),
    "hybrid-1-2-2-1": ("hybrid", 4, ["--cp", "2", "--tp", "2"], {}),
    "hybrid-1-2-1-2": ("hybrid", 4, ["--context-parallel-size", "2", "--pp", "2"], {}),
    "hybrid-2-2-1-2-recompute": ("hybrid", 8, ["--cp", "2", "--pp", "2", "--checkpoint-activations-interval", "1"], {}),
    "mamba1-1-2-2-1-sp": ("mamba1", 4, ["--cp", "2", "--tp", "2", "--sequence-parallel"], {}),
}


def _flags(mixer, packed_documents):
    return packed_documents if mixer == "hybrid" else []


def _run(train_runs, mixer, world, flags, ds_changes=None):
    run = train_runs.launched(world, mixer, flags, train_runs.ds_config(**ds_changes) if ds_changes else None)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    return run


def _launched(train_runs, packed_documents, name):
    mixer, world, flags, ds_changes = LAYOUTS[name]
    return _run(train_runs, mixer, world, [*_flags(mixer, packed_documents), *flags], ds_changes)


def _reference(train_runs, packed_documents, mixer):
    return _run(train_runs, mixer, 1, _flags(mixer, packed_documents))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_single_rank_loss_curve(train_runs, packed_documents, name):
    run = _launched(train_runs, packed_documents, name)
    ref = _reference(train_runs, packed_documents, LAYOUTS[name][0])["records"]
    for key in ("loss", "grad_norm", "val_loss"):
        error = relative_curve_error(losses(run["records"], key), losses(ref, key))
        print(f"{name} (launcher): max relative {key} difference to (1,1,1,1) {error:.1e}")
        assert error <= 1e-4, (key, losses(run["records"], key), losses(ref, key))


def test_the_console_names_the_context_parallel_size_and_the_hybrids_layer_kinds(train_runs, packed_documents):
    stdout = _launched(train_runs, packed_documents, "hybrid-2-2-1-2-recompute")["stdout"]
    assert (
        "layout: world 8 = dp 2 x cp 2 x tp 1 x pp 2 | micro batch 2 x grad accumulation 2 x dp 2 = global "
        "batch 8" in stdout
    )
    assert "run: Mamba2, 3 layers (1 Mamba2, 1 attention, 1 MLP), d_model 64 | parameters " in stdout


def test_zero2_partitions_the_hybrids_optimizer_state_over_dp(train_runs, packed_documents):
    stdout = _launched(train_runs, packed_documents, "hybrid-2-1-1-1-zero2")["stdout"]
    assert "ZeRO stage 2" in stdout and " = 12.000 x stage parameters / dp" in stdout


def test_a_tp2_pp2_hybrid_checkpoint_continues_the_curve_at_dp2_with_zero2(train_runs, packed_documents):
    """Saved with the key/value head replicated over TP 2 and the layers on 2 stages; read as one
    TP-1 stage whose ZeRO-2 partitions split the optimizer state over 2 data ranks."""
    saved = _launched(train_runs, packed_documents, "hybrid-1-1-2-2")["dir"] / "ckpt" / f"step_{SAVE_AT:06d}"
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["extra"]["layout"] == {"dp": 1, "cp": 1, "tp": 2, "pp": 2, "ep": 1}
    run = _run(train_runs, "hybrid", 2, [*packed_documents, "--load", str(saved)], ZERO_2)
    assert [r["step"] for r in run["records"]] == list(range(SAVE_AT, 5))
    ref = _reference(train_runs, packed_documents, "hybrid")["records"][SAVE_AT:]
    for key in ("loss", "grad_norm", "val_loss"):
        error = relative_curve_error(losses(run["records"], key), losses(ref, key))
        print(f"hybrid (1,1,2,2) step {SAVE_AT} -> (2,1,1,1) ZeRO-2: max relative {key} difference {error:.1e}")
        assert error <= 1e-4, (key, losses(run["records"], key), losses(ref, key))
