"""Whether a run's memory plan fits its devices, and which single layout change would make it fit.

On a GPU a rank may use its device's total memory less RESERVED (CUDA context, communication
buffers, allocator fragmentation); the ranks agree on the smallest device. On the CPU the
"device" memory is the host's, shared by every rank on the node (and everything else running
there): the plan is printed, the fit is not checked.

A run that does not fit is refused before any model is built, with the changes that fit, each
computed by planning the changed run: twice the tensor or pipeline parallel size at the same
context parallel size (on the same world size when the global batch still splits over
dp = world / (cp x tp x pp), else on twice the ranks; not the pipeline size a pattern's | marks
fix), the next ZeRO stage (when there are dp x cp > 1 ranks to
shard over), the largest smaller micro batch that keeps the global batch, recomputation of every
layer, a tenth of ZeRO's default reduce bucket.
"""

import argparse
from dataclasses import replace
from typing import Optional

from megamamba.errors import LayoutError
from megamamba.model.layers import check_layout
from megamamba.pipelines.loop.agreement import agree
from megamamba.pipelines.memory.plan import GiB, MemoryPlan, RunShape, gib, plan_lines, plan_memory
from megamamba.pipelines.stages.partition import check_pattern_stages

RESERVED = 2 * GiB
SMALL_BUCKET = int(5e7)  # a tenth of DeepSpeed's default reduce bucket: 200 MB of float32 instead of 2 GB


class MemoryPlanError(LayoutError):
    """The worst rank of the plan needs more than its device holds; the message names what fits."""


def device_memory() -> Optional[int]:
    """This rank's device memory in bytes; None on the CPU (host memory, not checked)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else int(accelerator.total_memory())


def _regrid(shape: RunShape, tp: int, pp: int) -> Optional[tuple]:
    """(label, shape) at tensor size `tp` and pipeline size `pp`, same context size, global and micro
    batch; None if the model or the global batch cannot be split so."""
    layout, model = shape.layout, shape.model
    try:
        check_layout(model, tp)
        check_pattern_stages(model, pp)  # a pattern's | marks fix the stage count
    except LayoutError:
        return None
    if model.n_layer < pp or (shape.sequence_parallel and shape.seq_length % tp):
        return None
    world, model_ranks = layout.world_size, layout.cp * tp * pp
    if world % model_ranks or layout.global_batch_size % (layout.micro_batch_size * world // model_ranks):
        world *= 2  # dp stays: the change needs more ranks
    if world % model_ranks or layout.global_batch_size % (layout.micro_batch_size * world // model_ranks):
        return None
    dp = world // model_ranks
    accum = layout.global_batch_size // (layout.micro_batch_size * dp)
    flag = f"--tensor-parallel-size {tp}" if tp != layout.tp else f"--pipeline-parallel-size {pp}"
    where = "" if world == layout.world_size else f" on {world} ranks"
    return flag + where, shape.changed(layout=replace(layout, world_size=world, dp=dp, tp=tp, pp=pp, grad_accum=accum))


def alternatives(shape: RunShape) -> list:
    """(label, changed shape) for each single change but the micro batch that lowers a rank's memory."""
    layout = shape.layout
    changes = [_regrid(shape, layout.tp * 2, layout.pp), _regrid(shape, layout.tp, layout.pp * 2)]
    if shape.zero_stage < (1 if layout.pp > 1 else 2) and layout.dp * layout.cp > 1:
        stage = shape.zero_stage + 1
        changes.append((f"zero_optimization.stage {stage}", shape.changed(zero_stage=stage)))
    if shape.checkpoint_interval != 1:
        changes.append(("--checkpoint-activations-interval 1", shape.changed(checkpoint_interval=1)))
    if shape.zero_stage in (1, 2) and shape.contiguous_gradients and shape.reduce_bucket_size > SMALL_BUCKET:
        changes.append(
            (f"zero_optimization.reduce_bucket_size {SMALL_BUCKET}", shape.changed(reduce_bucket_size=SMALL_BUCKET))
        )
    return [c for c in changes if c is not None]


def smaller_micro_batches(shape: RunShape) -> list:
    """(label, changed shape) for each smaller micro batch that keeps the global batch, largest first."""
    layout = shape.layout
    return [
        (
            f"micro batch {m} (train_micro_batch_size_per_gpu / --micro-batch-size)",
            shape.changed(
                layout=replace(layout, micro_batch_size=m, grad_accum=layout.global_batch_size // (m * layout.dp))
            ),
        )
        for m in range(layout.micro_batch_size - 1, 0, -1)
        if layout.global_batch_size % (m * layout.dp) == 0
    ]


def refusal(plan: MemoryPlan, device_bytes: int) -> Optional[str]:
    """None when the plan's worst rank fits `device_bytes` less RESERVED, else the one-line reason."""
    usable = device_bytes - RESERVED
    worst = plan.worst
    if worst.total <= usable:
        return None
    options = [(label, plan_memory(changed).worst.total) for label, changed in alternatives(plan.shape)]
    micro = None
    for label, changed in smaller_micro_batches(plan.shape):
        micro = (label, plan_memory(changed).worst.total)
        if micro[1] <= usable:
            break
    options += [micro] if micro else []
    fits = [o for o in options if o[1] <= usable]
    said = ", ".join(f"{label} ({gib(total)} GiB)" for label, total in fits or options)
    verdict = f"fits with: {said}" if fits else f"no single change fits: {said}"
    return (
        f"memory plan: a rank of pipeline stage {worst.stage} needs {gib(worst.total)} GiB (parameters "
        f"{gib(worst.parameters)}, gradients {gib(worst.gradients)}, optimizer state {gib(worst.optimizer)}, "
        f"DeepSpeed buffers ~{gib(worst.buffers)}, activations ~{gib(worst.activations)}) but its device has "
        f"{gib(usable)} GiB ({gib(device_bytes)} less {gib(RESERVED)} reserved); {verdict}; "
        f"--no-memory-check starts anyway"
    )


def check_at_start(plan: MemoryPlan, skip: bool) -> list:
    """Global rank 0's start-up lines for the plan; raises MemoryPlanError unless it fits or `skip`.

    Collective on a GPU (the ranks agree on the smallest device), so every rank reaches the same verdict.
    """
    device_bytes = device_memory()
    if device_bytes is None:
        from deepspeed.accelerator import get_accelerator

        host = get_accelerator().total_memory()
        return plan_lines(plan) + [
            f"  device: the CPU, whose memory is the host's ({gib(host)} GiB shared by the "
            "node's ranks): fit not checked"
        ]
    device_bytes = int(-agree([-device_bytes], op="max")[0])
    reason = refusal(plan, device_bytes)
    if reason is not None and not skip:
        raise MemoryPlanError(reason)
    verdict = "fits" if reason is None else "DOES NOT FIT, starting anyway (--no-memory-check)"
    return plan_lines(plan) + [f"  device: {gib(device_bytes)} GiB less {gib(RESERVED)} reserved: {verdict}"]


def add_memory_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's flag for the start-up memory check (docs/flags.md)."""
    p = parser.add_argument_group("memory")
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="start even when the start-up memory plan says a rank does not fit its GPU",
    )
