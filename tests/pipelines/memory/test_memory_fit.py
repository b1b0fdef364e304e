"""A run whose memory plan does not fit its device is refused before anything is built, naming the
single layout changes that fit (each computed by planning the changed run)."""

import contextlib
import dataclasses
import io
import os

import pytest

from distributed import run_ranks
from megamamba.config import MambaConfig
from megamamba.pipelines.config.layout import Layout
from megamamba.pipelines.memory import fit as memory_fit
from megamamba.pipelines.memory.fit import RESERVED, alternatives, refusal
from megamamba.pipelines.memory.plan import GiB, RunShape, plan_memory
from train_entry import ROOT, load_train_script


def _plan(**changes):
    """mamba2-130m on 2 ranks (dp 2), micro batch 8 x seq 2048, bf16 autocast, ZeRO 0."""
    shape = RunShape(
        model=MambaConfig.from_json(str(ROOT / "launch/models/mamba2-130m.json")),
        layout=Layout(world_size=2, dp=2, tp=1, pp=1, micro_batch_size=8, grad_accum=1),
        seq_length=2048,
        autocast=True,
    )
    return plan_memory(shape.changed(**changes))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_context_parallel_ranks_share_optimizer_state_as_data_parallel_ones_do(zero):
    """ZeRO shards over DeepSpeed's data axis, dp x cp ranks: (dp 1, cp 2) holds what (dp 2, cp 1) does."""
    by_cp = _plan(
        zero_stage=zero, layout=Layout(world_size=2, dp=1, tp=1, pp=1, micro_batch_size=8, grad_accum=2, cp=2)
    ).worst
    by_dp = _plan(zero_stage=zero).worst
    assert (by_cp.parameters, by_cp.gradients, by_cp.optimizer, by_cp.buffers) == (
        by_dp.parameters,
        by_dp.gradients,
        by_dp.optimizer,
        by_dp.buffers,
    )


def test_a_plan_that_fits_its_device_is_not_refused():
    plan = _plan()
    assert refusal(plan, plan.worst.total + RESERVED) is None


def test_a_plan_too_large_for_its_device_is_refused_with_the_changes_that_fit():
    plan = _plan()
    message = refusal(plan, plan.worst.total + RESERVED - 1)
    assert message is not None and "\n" not in message
    assert f"needs {plan.worst.total / GiB:.2f} GiB" in message
    fits = message.split("fits with: ")[1].split("; --no-memory-check")[0]
    # The largest smaller micro batch keeping the global batch of 16 on dp 2 is 4.
    for change in (
        "--checkpoint-activations-interval 1",
        "micro batch 4",
        "--pipeline-parallel-size 2",
        "--tensor-parallel-size 2",
    ):
        assert change in fits, (change, message)
    assert "zero_optimization" not in fits  # ZeRO-1's 1.86 GiB gradient bucket outweighs what it saves here


def test_a_change_that_does_not_fit_is_not_offered():
    plan = _plan()
    recompute = plan_memory(plan.shape.changed(checkpoint_interval=1)).worst.total
    tp2 = plan_memory(plan.shape.changed(layout=Layout(2, 1, 2, 1, 8, 2))).worst.total
    assert recompute < tp2
    message = refusal(plan, recompute + RESERVED)
    assert "fits with: --checkpoint-activations-interval 1" in message, message
    assert "--tensor-parallel-size" not in message, message


def test_a_smaller_zero_bucket_is_offered_when_the_bucket_makes_the_difference():
    plan = _plan(zero_stage=1)  # its 5e8-element float32 bucket: 1.86 GiB
    message = refusal(plan, plan.worst.total + RESERVED - GiB)
    assert "zero_optimization.reduce_bucket_size 50000000 (" in message.split("fits with: ")[1], message


def test_when_no_single_change_fits_the_refusal_says_so_with_each_ones_figure():
    message = refusal(_plan(), RESERVED + GiB // 2)
    assert "no single change fits: " in message, message
    assert "--checkpoint-activations-interval 1 (" in message and "micro batch 1 (" in message, message


def test_a_context_parallel_runs_offers_are_planned_on_its_world_size():
    """World 8 = dp 2 x cp 4: doubling tp or pp halves dp and keeps cp 4 and the global batch of 32."""
    layout = Layout(world_size=8, dp=2, tp=1, pp=1, micro_batch_size=8, grad_accum=2, cp=4)
    offers = {label: changed.layout for label, changed in alternatives(_plan(layout=layout).shape)}
    assert offers["--tensor-parallel-size 2"] == Layout(8, 1, 2, 1, 8, 4, cp=4), offers
    assert offers["--pipeline-parallel-size 2"] == Layout(8, 1, 1, 2, 8, 4, cp=4), offers


def test_a_pattern_whose_marks_fix_the_stages_is_offered_no_other_pipeline_size():
    model = MambaConfig.from_json(str(ROOT / "launch/models/nemotron-h-8b.json"))
    pattern = model.hybrid_layer_pattern
    model = dataclasses.replace(model, hybrid_layer_pattern=pattern[:26] + "|" + pattern[26:])
    layout = Layout(world_size=8, dp=2, tp=2, pp=2, micro_batch_size=1, grad_accum=8)
    shape = RunShape(model=model, layout=layout, seq_length=8192, zero_stage=1, autocast=True)
    labels = [label for label, _ in alternatives(shape)]
    assert "--tensor-parallel-size 4" in labels and not any("--pipeline-parallel-size" in x for x in labels), labels
    assert "--pipeline-parallel-size" not in refusal(plan_memory(shape), 8 * GiB)


def test_zero_is_offered_to_a_run_whose_data_axis_is_its_context_ranks():
    """dp 1 x cp 2: ZeRO shards over DeepSpeed's data axis of dp x cp = 2 ranks."""
    layout = Layout(world_size=2, dp=1, tp=1, pp=1, micro_batch_size=8, grad_accum=2, cp=2)
    labels = [label for label, _ in alternatives(_plan(layout=layout).shape)]
    assert "zero_optimization.stage 1" in labels, labels


def _run_with_device(argv, extensions_dir, device_gib):
    """Run train.py's main with a pretend device of `device_gib` GiB: (exit status, stderr, stdout)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    memory_fit.device_memory = lambda: int(device_gib * GiB)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            load_train_script().main(argv)
            status = 0
        except SystemExit as e:
            status = e.code
    return status, err.getvalue(), out.getvalue()


def _argv(train_runs, *flags):
    return [
        "--deepspeed_config",
        train_runs.ds_config(),
        "--model-config",
        str(ROOT / "launch/models/mamba2-130m.json"),
        "--train-iters",
        "1",
        "--seq-length",
        "2048",
        *flags,
    ]


def test_train_py_refuses_a_run_that_does_not_fit_in_one_line_with_status_2(train_runs):
    ((status, err, out),) = run_ranks(
        _run_with_device,
        1,
        args=(_argv(train_runs), os.environ["TORCH_EXTENSIONS_DIR"], 3),
        init_process_group=False,
        timeout=300,
    )
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, (status, err)
    assert lines[0].startswith("train.py: error: memory plan: a rank of pipeline stage 0 needs"), lines
    # tiny-cpu.json: ZeRO 1 on one rank, so ZeRO 2 has no data axis to shard over and is not offered.
    offered = lines[0].split("no single change fits: ")[1].split("; --no-memory-check")[0]
    for change in (
        "--tensor-parallel-size 2 on 2 ranks (",
        "--pipeline-parallel-size 2 on 2 ranks (",
        "--checkpoint-activations-interval 1 (",
        "zero_optimization.reduce_bucket_size 50000000 (",
        "micro batch 1 (",
    ):
        assert change in offered, (change, lines)
    assert "zero_optimization.stage" not in offered, lines
    assert "memory plan, GiB per rank" not in out  # refused before the plan is printed as accepted


def test_on_the_cpu_the_plan_is_printed_and_the_fit_not_checked(monkeypatch):
    monkeypatch.setattr(memory_fit, "device_memory", lambda: None)
    lines = memory_fit.check_at_start(_plan(), skip=False)
    assert lines[0].startswith("memory plan, GiB per rank of stage 0 (the largest): parameters 0.48"), lines
    assert lines[-1].startswith("  device: the CPU, whose memory is the host's") and "fit not checked" in lines[-1]


@pytest.mark.slow
def test_no_memory_check_starts_a_run_that_does_not_fit_and_says_so(train_runs):
    argv = [
        "--deepspeed_config",
        train_runs.ds_config(),
        "--model-config",
        train_runs.model_config("mamba2"),
        "--train-iters",
        "1",
        "--seq-length",
        "32",
        "--no-memory-check",
    ]
    ((status, err, out),) = run_ranks(
        _run_with_device, 1, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"], 1), init_process_group=False, timeout=300
    )
    assert status == 0, (status, err[-2000:])
    assert "memory plan, GiB per rank" in out, out[-2000:]
    assert "DOES NOT FIT, starting anyway (--no-memory-check)" in out, out[-2000:]


def test_nemotron_h_8b_fits_eight_80_gb_devices_at_tp_2_with_sequence_parallelism_and_zero_2():
    """launch/configs/nemotron-h-8b.json at seq 8192 on 8 ranks with --tp 2 --sequence-parallel (dp 4, micro batch
    1, no recomputation): 66.17 GiB a rank by the plan, under 80 GB (74.5 GiB) less the reserve."""
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            str(ROOT / "launch/configs/nemotron-h-8b.json"),
            "--model-config",
            str(ROOT / "launch/models/nemotron-h-8b.json"),
            "--seq-length",
            "8192",
            "--train-iters",
            "1",
            "--tp",
            "2",
            "--sequence-parallel",
        ]
    )
    plan = script.prepare(args, 8)
    memory = plan_memory(
        RunShape.of_run(
            plan.model,
            plan.layout,
            plan.engine_config,
            args.seq_length,
            args.partition_method,
            args.checkpoint_activations_interval,
            args.sequence_parallel,
        )
    )
    worst = memory.worst
    print(
        f"nemotron-h-8b {plan.layout}: parameters {worst.parameters / GiB:.2f}, gradients "
        f"{worst.gradients / GiB:.2f}, optimizer {worst.optimizer / GiB:.2f}, buffers {worst.buffers / GiB:.2f}, "
        f"activations {worst.activations / GiB:.2f}, total {worst.total / GiB:.2f} GiB"
    )
    assert (plan.layout.dp, plan.layout.tp, plan.layout.pp, plan.layout.micro_batch_size) == (4, 2, 1, 1)
    assert refusal(memory, 80 * 10**9) is None


def test_mamba3_1_5b_fits_eight_80_gb_devices_as_its_config_says():
    """launch/configs/mamba3-1.5b.json (micro batch 2, ZeRO 1, bf16 autocast) with launch/models/mamba3-1.5b.json
    at seq 2048 on 8 data-parallel ranks: under 80 GB less the reserve by the plan."""
    script = load_train_script()
    argv = ["--deepspeed_config", str(ROOT / "launch/configs/mamba3-1.5b.json"), "--seq-length", "2048"]
    args = script.parse_args(
        [*argv, "--model-config", str(ROOT / "launch/models/mamba3-1.5b.json"), "--train-iters", "1"]
    )
    plan = script.prepare(args, 8)
    memory = plan_memory(
        RunShape.of_run(plan.model, plan.layout, plan.engine_config, args.seq_length, "cost", 0, False)
    )
    print(f"mamba3-1.5b {plan.layout}: total {memory.worst.total / GiB:.2f} GiB a rank")
    assert (plan.layout.dp, plan.layout.micro_batch_size, plan.layout.global_batch_size) == (8, 2, 256)
    assert refusal(memory, 80 * 10**9) is None
