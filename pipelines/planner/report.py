"""The planner's answer as console lines (a ranked table, where the best plan's time goes, the rejected
families) or as one JSON object with the same content."""

import json
from dataclasses import asdict

from megamamba.pipelines.planner.search import MFU_MARGIN, Plan, Search

GiB = 2**30
TIME_PARTS = (
    "compute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pipeline_sends",
    "bubble",
    "data_parallel",
    "optimizer",
    "overhead",
)
ASSUMPTIONS = (
    "TP inside a node, with sequence parallelism",
    "TP, CP and EP sizes powers of two; EP only for a model with mixture-of-experts layers, ZeRO 0-2",
    "expert gradients reduced over the whole data axis (an upper bound: they reduce over dp x cp / ep ranks)",
    "ZeRO 0 or 1 with pp > 1 (DeepSpeed's pipeline engine refuses 2 and 3)",
    "ZeRO 3 only when fixed (the memory plan counts its partition, not its gathered parameters)",
    "recompute every layer or none",
    "the cost partition",
    "DeepSpeed's ZeRO defaults (5e8-element buckets, overlap_comm with ZeRO 3 only)",
)


def train_flags(plan: Plan) -> str:
    """launch/train.py's layout flags for `plan`."""
    return (
        f"--tensor-parallel-size {plan.tp} --pipeline-parallel-size {plan.pp} --context-parallel-size {plan.cp}"
        + (f" --expert-model-parallel-size {plan.ep}" if plan.ep > 1 else "")
        + (" --sequence-parallel" if plan.sequence_parallel else "")
        + (" --checkpoint-activations-interval 1" if plan.recompute else "")
    )


def deepspeed_keys(plan: Plan) -> dict:
    """The DeepSpeed JSON keys `plan` sets."""
    return {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "zero_optimization": {"stage": plan.zero_stage},
    }


def plan_dict(plan: Plan) -> dict:
    return {
        "dp": plan.dp,
        "cp": plan.cp,
        "tp": plan.tp,
        "pp": plan.pp,
        "ep": plan.ep,
        "zero_stage": plan.zero_stage,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "recompute": plan.recompute,
        "sequence_parallel": plan.sequence_parallel,
        "memory_bytes": {k: v for k, v in asdict(plan.memory).items() if k != "stage"}
        | {"total": plan.memory.total, "stage": plan.memory.stage},
        "step_seconds": {k: getattr(plan.time, k) for k in TIME_PARTS} | {"total": plan.time.total},
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
        "mfu": plan.mfu,
        "train_flags": train_flags(plan),
        "deepspeed_config": deepspeed_keys(plan),
    }


def search_dict(result: Search, top: int) -> dict:
    r = result.request
    return {
        "gpus": r.gpus,
        "gpus_per_node": r.gpus_per_node,
        "seq_length": r.seq_length,
        "global_batch_size": r.global_batch_size,
        "device_memory_bytes": r.device_memory,
        "fixed": r.fixed,
        "assumptions": list(ASSUMPTIONS),
        "feasible": len(result.plans),
        "measured_mfu": result.measured_mfu,
        "plans": [plan_dict(p) | {"mfu_extrapolated": extrapolated(result, p)} for p in result.plans[:top]],
        "rejected": [{"family": x.family, "reason": x.reason} for x in result.rejected],
    }


def extrapolated(result: Search, plan: Plan) -> bool:
    """Whether `plan`'s MFU is above the best measured on the profile's GPU by more than MFU_MARGIN."""
    return result.measured_mfu is not None and plan.mfu > result.measured_mfu + MFU_MARGIN


def _row(rank: int, p: Plan, mark: str) -> str:
    m = p.memory
    gib = " ".join(
        f"{getattr(m, k) / GiB:6.2f}"
        for k in ("parameters", "gradients", "optimizer", "buffers", "activations", "total")
    )
    return (
        f"{rank:>3}  {p.dp:>3} {p.cp:>3} {p.tp:>3} {p.pp:>3} {p.ep:>3}  {p.zero_stage:>4}  {p.micro_batch_size:>5} x "
        f"{p.grad_accum:<5} {'on' if p.recompute else 'off':>4}  {gib}  "
        f"{p.time.total:9.3f} {p.tokens_per_s_per_gpu:11.0f} {100 * p.mfu:5.1f}%{mark}"
    )


def search_lines(result: Search, top: int) -> list:
    r = result.request
    lines = [
        f"plans for {r.gpus} GPUs ({r.gpus_per_node} per node, {r.device_memory / GiB:.1f} GiB each), seq "
        f"{r.seq_length}, global batch {r.global_batch_size}: {len(result.plans)} feasible"
        + (f", fixed {r.fixed}" if r.fixed else ""),
        f"assumed: {'; '.join(ASSUMPTIONS)}",
        "rank   dp  cp  tp  pp  ep  ZeRO  micro x accum  rec  GiB: param  grads  optim   bufs   acts  total"
        "     step s  tok/s/GPU    MFU",
    ]
    shown = result.plans[:top]
    lines += [_row(i + 1, p, "*" if extrapolated(result, p) else "") for i, p in enumerate(shown)]
    if any(extrapolated(result, p) for p in shown):
        lines.append(
            f"* MFU above the best measured on this GPU ({100 * (result.measured_mfu or 0):.1f}%) plus "
            f"{100 * MFU_MARGIN:.0f} points: an extrapolation beyond the profile's measured runs"
        )
    if result.plans:
        best = result.plans[0]
        parts = ", ".join(
            f"{k.replace('_', ' ')} {getattr(best.time, k):.3f} s "
            f"({100 * getattr(best.time, k) / best.time.total:.0f}%)"
            for k in TIME_PARTS
        )
        lines.append(f"best plan's step: {parts}")
        lines.append(
            f"run it: launch/train.py {train_flags(best)} --seq-length {r.seq_length}, DeepSpeed JSON "
            f"{json.dumps(deepspeed_keys(best))}"
        )
    lines += [f"rejected {x.family}: {x.reason}" for x in result.rejected]
    return lines
