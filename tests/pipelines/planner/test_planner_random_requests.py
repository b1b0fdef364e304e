"""The planner on seeded random requests (model, GPUs per node and in all, sequence, batch, fixed settings):
every request ends as plans or as one PlanError, never another exception, and the best plan passes the start-up
checks of the run its flags launch (train.py's layout checks and memory fit)."""

import os
import random

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import check_run, engine_config, resolve_layout
from megamamba.pipelines.memory.fit import refusal
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import PlanError, Request, search
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION
from train_entry import ROOT

H100 = load_profile(os.path.join(ROOT, "launch/profiles/h100-80gb.json"))
MODELS = ["tiny-hybrid.json", "mamba1-130m.json", "mamba2-370m.json", "nemotron-h-8b.json", "mamba2-1.3b.json"]
SEEDS = range(24)


def random_request(seed: int) -> Request:
    rng = random.Random(seed)
    node = rng.choice([1, 2, 4, 8])
    gpus = node * rng.choice([1, 1, 2, 3])
    fixed = {}
    for name, values in (("micro_batch_size", [1, 2, 3]), ("zero_stage", [0, 1, 2, 3]), ("tp", [1, 2]), ("pp", [1, 2])):
        if rng.random() < 0.25:
            fixed[name] = rng.choice(values)
    model = MambaConfig.from_json(os.path.join(ROOT, "launch/models", rng.choice(MODELS)))
    seq, batch = rng.choice([512, 2048, 4096]), rng.choice([1, 6, 8, 24, 64])
    return Request(model, gpus, node, seq, batch, rng.choice([16, 80]) * 2**30, rng.random() < 0.5, fixed)


def _start_up_check(request: Request, plan) -> None:
    ds_config = {
        "train_batch_size": request.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "zero_optimization": {"stage": plan.zero_stage},
        "bf16": {"enabled": request.autocast},
    }
    layout = resolve_layout(request.gpus, plan.tp, plan.pp, ds_config, plan.cp)
    assert (layout.dp, layout.grad_accum) == (plan.dp, plan.grad_accum)
    check_run(layout, ds_config, request.model, request.seq_length, plan.sequence_parallel, None)
    shape = RunShape.of_run(
        request.model,
        layout,
        engine_config(ds_config, layout, None, plan.sequence_parallel),
        request.seq_length // plan.cp,
        DEFAULT_PARTITION,
        1 if plan.recompute else 0,
        plan.sequence_parallel,
    )
    memory = plan_memory(shape)
    assert memory.worst.total == plan.memory.total
    assert refusal(memory, request.device_memory) is None, plan


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_request_ends_in_plans_that_start_or_in_one_plan_error(seed):
    request = random_request(seed)
    try:
        result = search(request, H100)
    except PlanError as e:
        assert "\n" not in str(e) and str(e), (seed, str(e))
        return
    for name, value in request.fixed.items():
        assert all(getattr(plan, name) == value for plan in result.plans), (seed, name)
    _start_up_check(request, result.plans[0])
