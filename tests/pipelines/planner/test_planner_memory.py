"""A plan's memory is the start-up plan of the run its printed flags launch: launch/train.py, given the plan's
layout flags and DeepSpeed keys, computes the same per-rank parameters, gradients, optimizer state, buffers
and activations. (That start-up plan is the built engine's: tests/pipelines/memory/test_memory_plan.py.)

Plans of the tiny hybrid on 1, 2, 4 and 8 ranks: the fastest with each ZeRO stage and recompute setting,
and with each use of TP, PP and CP.
"""

import json
import shlex

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.report import deepspeed_keys, train_flags
from megamamba.pipelines.planner.search import Request, search
from train_entry import ROOT, load_train_script

MODEL = ROOT / "launch/models/tiny-hybrid.json"
CPU = load_profile(str(ROOT / "launch/profiles/cpu.json"))
SEQ, BATCH = 64, 16
GiB = 2**30


def _plans(world: int) -> list:
    """The fastest plan the planner finds on `world` ranks for each (ZeRO stage, recompute) and for each use of
    TP, PP and CP."""
    request = Request(MambaConfig.from_json(MODEL), world, world, SEQ, BATCH, 8 * GiB, autocast=False)
    fastest = {}
    for plan in search(request, CPU).plans:
        fastest.setdefault((plan.zero_stage, plan.recompute), plan)
        fastest.setdefault((plan.tp > 1, plan.pp > 1, plan.cp > 1), plan)
    return list({id(p): p for p in fastest.values()}.values())


PLANS = [(world, plan) for world in (1, 2, 4, 8) for plan in _plans(world)]


def test_the_plans_cover_one_to_eight_ranks_zero_0_to_2_and_recompute_on_and_off():
    assert len(PLANS) >= 8
    assert {w for w, _ in PLANS} == {1, 2, 4, 8}
    assert {p.zero_stage for _, p in PLANS} == {0, 1, 2}
    assert {p.recompute for _, p in PLANS} == {False, True}
    assert all(any(getattr(p, k) > 1 for _, p in PLANS) for k in ("tp", "pp", "cp"))


@pytest.mark.parametrize(
    "world, plan",
    PLANS,
    ids=[
        f"world{w}-dp{p.dp}-cp{p.cp}-tp{p.tp}-pp{p.pp}-zero{p.zero_stage}-micro{p.micro_batch_size}"
        f"-{'recompute' if p.recompute else 'keep'}"
        for w, p in PLANS
    ],
)
def test_a_plans_memory_is_the_start_up_plan_of_the_run_its_flags_launch(tmp_path, world, plan):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": BATCH, **deepspeed_keys(plan)}))
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            str(ds),
            "--model-config",
            str(MODEL),
            "--seq-length",
            str(SEQ),
            "--train-iters",
            "1",
            *shlex.split(train_flags(plan)),
        ]
    )
    run = script.prepare(args, world)
    start_up = plan_memory(
        RunShape.of_run(
            run.model,
            run.layout,
            run.engine_config,
            SEQ // run.layout.cp,
            args.partition_method,
            args.checkpoint_activations_interval,
            args.sequence_parallel,
        )
    )
    assert start_up.worst == plan.memory, (world, plan)
