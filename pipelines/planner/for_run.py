"""`launch/train.py --auto-parallel`: the planner run at start-up for this job's world size, node size and
device memory. What the user set (flags, the DeepSpeed JSON's micro batch and ZeRO stage) stays fixed; the
planner fills in the rest. Every rank computes the same choice from the same inputs, without a collective.
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from megamamba.config import MambaConfig
from megamamba.pipelines.config.moe_flags import moe_cfg_flags
from megamamba.pipelines.config.run_plan import layout_flags, model_config, read_deepspeed_config
from megamamba.pipelines.planner.profile import Profile, load_profile
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
        f"dp {plan.dp} x cp {plan.cp} x tp {plan.tp} x pp {plan.pp}{f', ep {plan.ep}' if plan.ep > 1 else ''}, "
        f"ZeRO {plan.zero_stage}, micro batch "
        f"{plan.micro_batch_size} x {plan.grad_accum} accumulation, recompute {'on' if plan.recompute else 'off'}"
        f" (predicted {plan.time.total:.3g} s a step, {plan.memory.total / 2**30:.2f} GiB per rank)"
    )


def choice_lines(choice: AutoChoice) -> list:
    lines = [f"auto-parallel ({choice.profile.name}): {describe(choice.best)}"]
    if choice.runner_up is not None:
        lines.append(f"  runner-up: {describe(choice.runner_up)}")
    return lines


PLANNED = {  # flag dests the planner can fill in, by its names
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "checkpoint_activations_interval": "recompute",
    "micro_batch_size": "micro_batch_size",
}


def auto_parallel(args: argparse.Namespace, given_dests: set, world_size: int, profiles: str) -> tuple:
    """--auto-parallel: the flags' layout (`LayoutFlags`) with the planner's choice for this job, and the lines
    saying what it chose; what the user set (`given_dests`, the flags given explicitly) stays; `profiles`: the
    folder of published profiles."""
    flags = layout_flags(args)
    ds_config = flags.with_batch(read_deepspeed_config(args.deepspeed_config))
    model = model_config(args.model_config, args.hybrid_layer_pattern, moe_cfg_flags(args))
    given = {PLANNED[dest]: getattr(args, dest) for dest in given_dests & set(PLANNED)}
    if "recompute" in given:
        given["recompute"] = given["recompute"] > 0
    accelerator = get_accelerator()
    local_ranks = int(os.environ.get("LOCAL_SIZE", world_size))
    if accelerator.device_name() == "cpu":  # the host's memory, shared by the node's ranks
        device, memory = None, accelerator.total_memory() // local_ranks
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device, memory = torch.cuda.get_device_name(local_rank), accelerator.total_memory(local_rank)
    profile = load_profile(args.plan_profile or default_profile(profiles, device))
    choice = choose(model, ds_config, given, world_size, local_ranks, memory, args.seq_length, profile)
    best = choice.best
    chosen = dataclasses.replace(
        flags,
        tp=best.tp,
        pp=best.pp,
        cp=best.cp,
        ep=best.ep,
        sequence_parallel=flags.sequence_parallel or best.sequence_parallel,
        micro_batch_size=best.micro_batch_size,
        zero_stage=best.zero_stage,
        checkpoint_interval=1 if best.recompute and "recompute" not in given else flags.checkpoint_interval,
    )
    return chosen, choice_lines(choice)


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's --auto-parallel and its profile (docs/flags.md)."""
    p = parser.add_argument_group("auto-parallel")
    p.add_argument(
        "--auto-parallel",
        action="store_true",
        help="choose tp, pp, cp, ep (with MoE layers), the ZeRO stage, the micro batch and recomputation with the "
        "planner (launch/plan.py) for this world size and device memory; what you set stays fixed",
    )
    p.add_argument(
        "--plan-profile",
        default=None,
        metavar="PROFILE",
        help="hardware profile for --auto-parallel (default: launch/profiles/ by GPU name; "
        "launch/profiles/cpu.json on the CPU)",
    )
