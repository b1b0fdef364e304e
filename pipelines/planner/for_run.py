"""`launch/train.py --auto-parallel`: the planner run at start-up for this job's world size, node size and
device memory. What the user set (flags, the DeepSpeed JSON's micro batch and ZeRO stage) stays fixed; the
planner fills in the rest. Every rank computes the same choice from the same inputs, without a collective.
"""

import os
from dataclasses import dataclass
from typing import Optional

from megamamba.config import MambaConfig
from megamamba.pipelines.planner.profile import Profile
from megamamba.pipelines.planner.search import Plan, PlanError, Request, search

PUBLISHED = {"H200": "h200.json", "H100": "h100-80gb.json", "A100": "a100-80gb.json"}  # by device name
CPU_PROFILE = "cpu.json"


@dataclass(frozen=True)
class AutoChoice:
    best: Plan
    runner_up: Optional[Plan]
    profile: Profile


def default_profile(profiles: str, device_name: Optional[str]) -> str:
    """The profile file in `profiles` for a GPU named `device_name` (None: the CPU)."""
    if device_name is None:
        return os.path.join(profiles, CPU_PROFILE)
    for key, file in PUBLISHED.items():
        if key in device_name:
            return os.path.join(profiles, file)
    raise PlanError(
        f"--auto-parallel has no profile for {device_name!r}: measure one with `python launch/plan.py "
        f"--calibrate --out P` and pass --plan-profile P"
    )


def fixed_settings(given: dict, ds_config: dict) -> dict:
    """What the planner must keep: `given` (planner names -> the values of flags the user set), and the JSON's
    micro batch and ZeRO stage when it sets them."""
    fixed = dict(given)
    if ds_config.get("train_micro_batch_size_per_gpu") is not None:
        fixed["micro_batch_size"] = ds_config["train_micro_batch_size_per_gpu"]
    if "stage" in ds_config.get("zero_optimization", {}):
        fixed["zero_stage"] = int(ds_config["zero_optimization"]["stage"])
    return fixed


def choose(
    model: MambaConfig,
    ds_config: dict,
    given: dict,
    world: int,
    gpus_per_node: int,
    device_memory: int,
    seq_length: int,
    profile: Profile,
) -> AutoChoice:
    """The fastest plan for this run, and the next one."""
    batch = ds_config.get("train_batch_size")
    if batch is None:
        raise PlanError(
            "--auto-parallel needs the global batch: set train_batch_size in the DeepSpeed config or "
            "--global-batch-size"
        )
    if ds_config.get("gradient_accumulation_steps") is not None:
        raise PlanError(
            "--auto-parallel chooses the accumulation steps from the global batch and the micro batch: "
            "remove gradient_accumulation_steps from the DeepSpeed config"
        )
    autocast = bool(ds_config.get("bf16", {}).get("enabled") or ds_config.get("torch_autocast", {}).get("enabled"))
    request = Request(
        model,
        world,
        min(gpus_per_node, world),
        seq_length,
        batch,
        device_memory,
        autocast,
        fixed_settings(given, ds_config),
    )
    plans = search(request, profile).plans
    return AutoChoice(plans[0], plans[1] if len(plans) > 1 else None, profile)


def describe(plan: Plan) -> str:
    return (
        f"dp {plan.dp} x cp {plan.cp} x tp {plan.tp} x pp {plan.pp}, ZeRO {plan.zero_stage}, micro batch "
        f"{plan.micro_batch_size} x {plan.grad_accum} accumulation, recompute {'on' if plan.recompute else 'off'}"
        f" (predicted {plan.time.total:.3g} s a step, {plan.memory.total / 2**30:.2f} GiB per rank)"
    )


def choice_lines(choice: AutoChoice) -> list:
    lines = [f"auto-parallel ({choice.profile.name}): {describe(choice.best)}"]
    if choice.runner_up is not None:
        lines.append(f"  runner-up: {describe(choice.runner_up)}")
    return lines
