"""Same seed, same data, float32, 5 steps: every (dp, tp, pp) layout trains the (1,1,1) loss curve.

Reference: (1,1,1) through the real `deepspeed` launcher. The layouts here run on directly
spawned gloo ranks ((1,2,2) and (2,2,2) go through the launcher: test_train_launcher.py); models
have 3 layers (not divisible by 2 stages). Options that must not change the math ride along:
sequence parallelism, activation checkpointing, each partition method, ZeRO stages ((2,1,1) for
Mamba-2 is the ZeRO-2/3 test below).
"""

import pytest
import torch

from megamamba.checkpoint import open_checkpoint
from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4

LAYOUTS = [
    # (dp, tp, pp), mixer, ZeRO stage, extra flags  (the reference runs ZeRO-1)
    ((2, 1, 1), "mamba1", 0, ["--torch-compile", "eager"]),
    ((1, 2, 1), "mamba1", 1, []),
    ((1, 2, 1), "mamba2", 1, ["--sequence-parallel"]),
    ((1, 1, 2), "mamba1", 0, ["--checkpoint-activations-interval", "2", "--partition-method", "uniform"]),
    ((1, 1, 2), "mamba2", 1, ["--partition-method", "parameters", "--torch-compile"]),
    ((2, 1, 2), "mamba1", 1, []),
    ((2, 1, 2), "mamba2", 1, ["--checkpoint-activations-interval", "1"]),
]


def _flags(layout, extra):
    dp, tp, pp = layout
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp), *extra]


@pytest.mark.parametrize(
    "layout, mixer, zero, extra", LAYOUTS, ids=[f"{m}-{lay}-zero{z}-{' '.join(e)}" for lay, m, z, e in LAYOUTS]
)
def test_layout_trains_the_single_rank_loss_curve(train_runs, train_reference, layout, mixer, zero, extra):
    ds = train_runs.ds_config(zero_optimization={"stage": zero})
    ranks = train_runs.spawned(layout[0] * layout[1] * layout[2], mixer, _flags(layout, extra), ds_config=ds)
    ref = train_reference(mixer)["records"]
    for rank, summary in enumerate(ranks):
        curve = losses(summary["records"])
        assert all(loss == loss for loss in curve), curve  # no NaN
        error = relative_curve_error(curve, losses(ref))
        print(f"{mixer} {layout} rank {rank}: max relative loss difference to (1,1,1) {error:.1e}")
        assert error <= TOLERANCE, (rank, curve, losses(ref))
        assert relative_curve_error(losses(summary["records"], "val_loss"), losses(ref, "val_loss")) <= TOLERANCE
        # The clipped global norm: every parameter once, the tied embedding too (ZeRO-0: pipelines.loop.clipping).
        assert relative_curve_error(losses(summary["records"], "grad_norm"), losses(ref, "grad_norm")) <= 1e-5


def test_loss_falls_over_the_five_steps(train_reference):
    for mixer in ("mamba1", "mamba2"):
        curve = losses(train_reference(mixer)["records"])
        assert curve[0] > 5.0 and curve[-1] < curve[0] - 0.05, (mixer, curve)


def test_zero1_holds_12_bytes_per_stage_parameter_over_dp_on_every_rank(train_runs):
    ranks = train_runs.spawned(
        4,
        "mamba2",
        _flags((2, 1, 2), ["--checkpoint-activations-interval", "1"]),
        ds_config=train_runs.ds_config(zero_optimization={"stage": 1}),
    )
    assert {s["stage_parameters"] for s in ranks} == {ranks[0]["stage_parameters"], ranks[-1]["stage_parameters"]}
    for rank, s in enumerate(ranks):
        expected = 12 * s["stage_parameters"] / 2
        # ZeRO pads each flat group to a multiple of the dp size: a few elements at most.
        assert expected <= s["optimizer_state_bytes"] <= expected + 12 * 2 * 8, (rank, s, expected)


# ZeRO-3 keeps no separate float32 master: the float32 parameter shard it owns is the master.
@pytest.mark.parametrize("stage, state_bytes_per_parameter", [(2, 12), (3, 8)])
def test_zero_2_and_3_at_pipeline_size_1_train_the_same_curve(
    train_runs, train_reference, stage, state_bytes_per_parameter
):
    ds = train_runs.ds_config(zero_optimization={"stage": stage})
    ranks = train_runs.spawned(2, "mamba2", [], ds_config=ds)
    for summary in ranks:
        reference = losses(train_reference("mamba2")["records"])
        assert relative_curve_error(losses(summary["records"]), reference) <= TOLERANCE
    expected = state_bytes_per_parameter * ranks[0]["stage_parameters"] / 2
    assert expected <= ranks[0]["optimizer_state_bytes"] <= expected * 1.01


def test_bf16_autocast_follows_the_float32_curve_with_float32_parameters(train_runs):
    longer = ["--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "3", "--eval-interval", "0"]
    (fp32,) = train_runs.spawned(1, "mamba2", longer)
    save = train_runs.root / "bf16-save"
    (bf16,) = train_runs.spawned(
        1,
        "mamba2",
        [*longer, "--save", str(save)],
        ds_config=train_runs.ds_config(
            torch_autocast={"enabled": True, "dtype": "bfloat16"}, zero_optimization={"stage": 0}
        ),
    )
    # Without ZeRO a checkpoint holds the parameters themselves and AdamW's state: A_log, D, dt_bias, every
    # weight and its moments stay float32.
    checkpoint = open_checkpoint("auto", str(save))
    tensors = {**checkpoint.model_tensors(), **checkpoint.optimizer_tensors()}
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    curve, ref = losses(bf16["records"]), losses(fp32["records"])
    assert ref[-1] < ref[0] - 0.5, ref  # a real stretch of training, not the flat start
    error = relative_curve_error(curve, ref)
    print(f"bf16 autocast vs float32, 30 steps: max relative loss difference {error:.2e}")
    assert 0 < error <= 1e-2, (error, curve, ref)  # > 0: the matmuls really ran in bf16
