"""The planner with mixture-of-experts models: it searches the expert-parallel size (powers of two dividing
dp x cp and the experts; ZeRO 0-2), counts the all-to-alls as EP communication, and every plan it lists passes
the start-up checks; the 30B-A3B-shaped config is planned with expert parallelism on 16 GPUs of 80 GB, and on 8
at the one layout that fits them (docs/moe.md)."""

import os

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import check_run, resolve_layout
from megamamba.pipelines.memory.plan import plan_memory
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import Request, run_shape, search
from train_entry import ROOT

H100 = load_profile(os.path.join(ROOT, "launch/profiles/h100-80gb.json"))
GiB = 2**30
TINY_MOE = MambaConfig.from_json(os.path.join(ROOT, "launch/models/tiny-moe-hybrid.json"))  # 8 experts
NANO = MambaConfig.from_json(os.path.join(ROOT, "launch/models/nemotron-3-nano-30b-a3b.json"))


@pytest.fixture(scope="module")
def moe_search():
    return search(Request(TINY_MOE, 8, 8, 256, 64, 16 * GiB), H100)


def test_expert_parallel_sizes_divide_dp_x_cp_and_the_experts(moe_search):
    sizes = {p.ep for p in moe_search.plans}
    assert sizes == {1, 2, 4, 8}, sizes
    for p in moe_search.plans:
        assert (p.dp * p.cp) % p.ep == 0 and 8 % p.ep == 0 and p.sequence_parallel == (p.tp > 1), p
        assert p.ep == 1 or p.zero_stage < 3, p
        assert (p.time.ep_comm > 0) == (p.ep > 1), p


def test_every_listed_expert_parallel_plan_passes_the_start_up_checks(moe_search):
    for p in [p for p in moe_search.plans if p.ep > 1][:10]:
        batch = {"train_micro_batch_size_per_gpu": p.micro_batch_size, "gradient_accumulation_steps": p.grad_accum}
        ds_config = {**batch, "zero_optimization": {"stage": p.zero_stage}}
        layout = resolve_layout(8, p.tp, p.pp, ds_config, p.cp, p.ep)
        check_run(layout, ds_config, TINY_MOE, 256, p.sequence_parallel, None)
        shape = run_shape(
            moe_search.request, p.dp, p.cp, p.tp, p.pp, p.zero_stage, p.micro_batch_size, p.recompute, p.ep
        )
        assert plan_memory(shape).worst == p.memory, p


def test_a_fixed_expert_parallel_size_is_kept():
    result = search(Request(TINY_MOE, 8, 8, 256, 64, 16 * GiB, fixed={"ep": 4}), H100)
    assert {p.ep for p in result.plans} == {4}
    assert any("ep 4" in x.reason for x in result.rejected)  # dp x cp of 2 or 1 cannot hold it


def test_the_30b_a3b_shape_is_planned_with_experts_split_on_16_80gb_gpus_and_on_8():
    best = search(Request(NANO, 16, 8, 8192, 128, 80 * GiB), H100).plans[0]
    assert best.ep > 1 and best.memory.total <= 78 * GiB, best
    eight = search(Request(NANO, 8, 8, 8192, 64, 80 * GiB), H100).plans[0]
    assert (eight.dp, eight.cp, eight.tp, eight.pp, eight.ep, eight.zero_stage) == (1, 2, 1, 4, 2, 0), eight
