"""The planner: every plan it lists fits as the start-up check decides, settings the user fixed are kept,
impossible layouts are rejected by family with their rule, and impossible requests are one clear error."""

import os

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import check_run, engine_config, resolve_layout
from megamamba.pipelines.memory.fit import refusal
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import PlanError, Request, run_shape, search
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION
from train_entry import ROOT

H100 = load_profile(os.path.join(ROOT, "launch/profiles/h100-80gb.json"))
GiB = 2**30


def model(name: str) -> MambaConfig:
    return MambaConfig.from_json(os.path.join(ROOT, "launch/models", name))


@pytest.fixture(scope="module")
def small_search():
    """mamba2-130m on 8 GPUs of 16 GiB, seq 2048, 64 sequences a step."""
    return search(Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB), H100)


def test_every_listed_plan_passes_the_start_up_memory_check(small_search):
    assert small_search.plans
    for plan in small_search.plans[:20]:
        shape = run_shape(
            small_search.request,
            plan.dp,
            plan.cp,
            plan.tp,
            plan.pp,
            plan.zero_stage,
            plan.micro_batch_size,
            plan.recompute,
        )
        memory = plan_memory(shape)
        assert memory.worst == plan.memory
        assert refusal(memory, 16 * GiB) is None, plan


def test_plans_are_ranked_by_predicted_step_time(small_search):
    times = [p.time.total for p in small_search.plans]
    assert times == sorted(times)


def test_every_plan_keeps_the_global_batch(small_search):
    for plan in small_search.plans:
        assert plan.micro_batch_size * plan.grad_accum * plan.dp == 64
        assert plan.dp * plan.cp * plan.tp * plan.pp == 8


def test_a_fixed_setting_is_kept_and_the_rest_chosen():
    result = search(
        Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB, fixed={"tp": 2, "zero_stage": 1}), H100
    )
    assert result.plans and all(p.tp == 2 and p.zero_stage == 1 for p in result.plans)


def test_a_fixed_micro_batch_rejects_only_the_families_whose_replicas_it_does_not_divide():
    """Micro batch 4 of 8 sequences on 4 GPUs: dp 1 and 2 take it, dp 4 (2 sequences per replica) cannot."""
    result = search(Request(model("mamba2-130m.json"), 4, 4, 2048, 8, 16 * GiB, fixed={"micro_batch_size": 4}), H100)
    assert result.plans and all(p.micro_batch_size == 4 and p.dp <= 2 for p in result.plans)
    reasons = {r.family: r.reason for r in result.rejected}
    assert reasons["dp 4 x cp 1 x tp 1 x pp 1"] == "micro batch 4 does not divide the 2 sequences per replica of dp 4"


def test_a_pipeline_with_zero_2_fixed_is_refused_naming_the_engine():
    with pytest.raises(PlanError, match="pipeline engine runs ZeRO 0 or 1 only"):
        search(Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB, fixed={"pp": 2, "zero_stage": 2}), H100)


def test_tensor_parallel_sizes_the_heads_do_not_divide_are_rejected_with_the_numbers():
    hybrid = MambaConfig(
        d_model=96,
        n_layer=3,
        vocab_size=257,
        hybrid_layer_pattern="M*-",
        d_intermediate=192,
        attn_cfg={"num_heads": 6, "num_heads_kv": 2, "causal": True},
        ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16},
    )
    result = search(Request(hybrid, 8, 8, 256, 16, 16 * GiB), H100)
    reasons = {r.family: r.reason for r in result.rejected}
    assert "num_heads = 6 is not divisible by TP = 4" in reasons["dp 2 x cp 1 x tp 4 x pp 1"]
    assert all(p.tp in (1, 2) for p in result.plans)


def test_more_gpus_per_node_than_gpus_is_refused_with_the_fix():
    with pytest.raises(PlanError, match="--gpus-per-node 8 is more than --gpus 4: use --gpus-per-node 4"):
        search(Request(model("mamba2-130m.json"), 4, 8, 2048, 64, 16 * GiB), H100)


def test_a_model_that_fits_nowhere_names_the_closest_plan_and_the_memory_it_needs():
    with pytest.raises(
        PlanError,
        match=r"no plan fits 1 GPU of 16\.0 GiB: the closest, dp 1 x cp 1 x tp 1 x pp 1, "
        r"does not fit: at best .* GiB per GPU",
    ):
        search(Request(model("mamba2-7b.json"), 1, 1, 2048, 8, 16 * GiB), H100)


def test_a_batch_no_data_parallel_size_splits_is_refused_with_the_fix():
    with pytest.raises(PlanError, match="global batch 3 splits over no data-parallel size of 8 GPUs"):
        search(Request(model("mamba2-130m.json"), 8, 8, 2048, 3, 16 * GiB, fixed={"tp": 1, "pp": 1, "cp": 1}), H100)


def test_a_7b_plan_for_64_gpus_passes_the_start_up_checks_at_that_world_size():
    """Simulated start-up of the top plans: the layout checks of train.py's `prepare` and the memory fit,
    for 64 ranks of 80 GB, without building an engine."""
    request = Request(model("mamba2-7b.json"), 64, 8, 4096, 512, H100.device_memory_bytes)
    result = search(request, H100)
    for plan in result.plans[:3]:
        ds_config = {
            "train_batch_size": 512,
            "train_micro_batch_size_per_gpu": plan.micro_batch_size,
            "zero_optimization": {"stage": plan.zero_stage},
            "bf16": {"enabled": True},
        }
        layout = resolve_layout(64, plan.tp, plan.pp, ds_config, plan.cp)
        assert (layout.dp, layout.grad_accum) == (plan.dp, plan.grad_accum)
        check_run(layout, ds_config, request.model, 4096, plan.sequence_parallel, None)
        shape = RunShape.of_run(
            request.model,
            layout,
            engine_config(ds_config, layout, None, plan.sequence_parallel),
            4096 // plan.cp,
            DEFAULT_PARTITION,
            1 if plan.recompute else 0,
            plan.sequence_parallel,
        )
        memory = plan_memory(shape)
        assert memory.worst.total == plan.memory.total
        assert refusal(memory, H100.device_memory_bytes) is None, plan


def test_gpus_that_fill_no_whole_node_are_refused_naming_the_counts_either_side():
    with pytest.raises(PlanError, match="--gpus 12 is not a whole number of nodes of 8: use --gpus 8 or 16"):
        search(Request(model("mamba2-130m.json"), 12, 8, 2048, 64, 16 * GiB), H100)


def test_tensor_parallel_sizes_beyond_a_node_are_one_rejection():
    result = search(Request(model("mamba2-130m.json"), 32, 8, 2048, 64, 16 * GiB), H100)
    spanning = [r for r in result.rejected if "node" in r.reason]
    assert [(r.family, r.reason) for r in spanning] == [("tp > 8", "tensor parallelism stays inside a node of 8 GPUs")]


def test_a_fixed_tensor_parallel_size_beyond_a_node_is_refused_by_its_rule():
    with pytest.raises(
        PlanError, match="can run this model and sequence: tp 16 would span nodes of 8 GPUs: use tp 8 or less$"
    ):
        search(Request(model("mamba2-130m.json"), 32, 8, 2048, 64, 16 * GiB, fixed={"tp": 16}), H100)


def test_zero_3_is_planned_only_when_asked_for(small_search):
    """The memory plan counts ZeRO-3's partition, not its gathered parameters: the search does not pick it alone."""
    assert {p.zero_stage for p in small_search.plans} == {0, 1, 2}
    asked = search(Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB, fixed={"zero_stage": 3}), H100)
    assert asked.plans and {p.zero_stage for p in asked.plans} == {3}


def test_nothing_fitting_names_the_nearest_reason_first():
    """24 GPUs in nodes of 8 with micro batch 3 fixed and 32 sequences a step: every family that splits the
    batch is ruled out by the micro batch, which the error leads with, not the generic rule that TP stays in
    a node."""
    with pytest.raises(PlanError) as refused:
        search(Request(model("mamba2-130m.json"), 24, 8, 2048, 32, 16 * GiB, fixed={"micro_batch_size": 3}), H100)
    assert str(refused.value) == (
        "no plan for 24 GPUs with micro batch size 3: micro batch 3 does not divide the 4 sequences per replica "
        "of dp 8; micro batch 3 does not divide the 8 sequences per replica of dp 4; micro batch 3 does not "
        "divide the 16 sequences per replica of dp 2"
    )
