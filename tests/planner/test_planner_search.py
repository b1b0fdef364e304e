"""The planner: every plan it lists fits as the start-up check decides, settings the user fixed are kept,
impossible layouts are rejected by family with their rule, and impossible requests are one clear error."""
import os

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.memory.fit import refusal
from megamamba.pipelines.memory.plan import plan_memory
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import PlanError, Request, search
from megamamba.pipelines.planner.search import _shape as plan_shape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
        shape = plan_shape(small_search.request, plan.dp, plan.cp, plan.tp, plan.pp, plan.zero_stage,
                           plan.micro_batch_size, plan.recompute)
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
    result = search(Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB, fixed={"tp": 2, "zero_stage": 1}),
                    H100)
    assert result.plans and all(p.tp == 2 and p.zero_stage == 1 for p in result.plans)


def test_a_pipeline_with_zero_2_fixed_is_refused_naming_the_engine():
    with pytest.raises(PlanError, match="pipeline engine runs ZeRO 0 or 1 only"):
        search(Request(model("mamba2-130m.json"), 8, 8, 2048, 64, 16 * GiB, fixed={"pp": 2, "zero_stage": 2}), H100)


def test_tensor_parallel_sizes_the_heads_do_not_divide_are_rejected_with_the_numbers():
    hybrid = MambaConfig(d_model=96, n_layer=3, vocab_size=257, hybrid_layer_pattern="M*-", d_intermediate=192,
                         attn_cfg={"num_heads": 6, "num_heads_kv": 2, "causal": True},
                         ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16})
    result = search(Request(hybrid, 8, 8, 256, 16, 16 * GiB), H100)
    reasons = {r.family: r.reason for r in result.rejected}
    assert "num_heads = 6 is not divisible by TP = 4" in reasons["dp 2 x cp 1 x tp 4 x pp 1"]
    assert all(p.tp in (1, 2) for p in result.plans)


def test_more_gpus_per_node_than_gpus_is_refused_with_the_fix():
    with pytest.raises(PlanError, match="--gpus-per-node 8 is more than --gpus 4: use --gpus-per-node 4"):
        search(Request(model("mamba2-130m.json"), 4, 8, 2048, 64, 16 * GiB), H100)


def test_a_model_that_fits_nowhere_names_the_closest_plan_and_the_memory_it_needs():
    with pytest.raises(PlanError, match=r"no plan fits 1 GPUs of 16\.0 GiB: the closest, dp 1 x cp 1 x tp 1 x pp 1, "
                                        r"does not fit: at best .* GiB per GPU"):
        search(Request(model("mamba2-7b.json"), 1, 1, 2048, 8, 16 * GiB), H100)


def test_a_batch_no_data_parallel_size_splits_is_refused_with_the_fix():
    with pytest.raises(PlanError, match="global batch 3 splits over no data-parallel size of 8 GPUs"):
        search(Request(model("mamba2-130m.json"), 8, 8, 2048, 3, 16 * GiB, fixed={"tp": 1, "pp": 1, "cp": 1}),
               H100)
