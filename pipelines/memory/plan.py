"""The device memory each rank of a run will need, planned at start-up before any model exists.

Per pipeline stage (the ranks of a stage hold the same: tensor-parallel shards are equal in
size), in bytes:
  - parameters: float32, laid out as DeepSpeed lays them out: with ZeRO 1/2 each optimizer
    parameter group (decayed, not decayed; `megamamba.optim`; under expert parallelism the rank's
    experts, a group of their own partitioned over the expert-data-parallel ranks) is one flat buffer
    padded to a multiple of 2 x the ranks it is partitioned over, the parameters being views into it;
  - gradients: float32, the whole stage's (ZeRO 0/1, as backward leaves them in `.grad`), or this
    rank's partition of the padded groups (ZeRO 2/3);
  - optimizer state: AdamW's two float32 moments per parameter (ZeRO 0), or with ZeRO 1/2 this
    rank's partition of each padded group three times (float32 master copy and two moments; twice
    with ZeRO-3, whose parameter partition is the master);
  - DeepSpeed buffers: ZeRO's contiguous gradient bucket (reduce_bucket_size float32 elements,
    twice with overlap_comm, once more for the pipeline engine's reduction; measured equal), or
    without ZeRO the flattened all-reduce bucket (estimated: up to 5e8 elements, with dp > 1);
  - activations (estimated; `pipelines.memory.activations`).
Parameters, gradients and optimizer state are exact for ZeRO 0 and 1 (ZeRO 2: parameters and
optimizer state; its gradients pass through the reduce bucket): the parameter count of every
layer comes from the model's own modules built on the meta device for tensor-parallel rank 0,
the stages as the pipeline module cuts them (`pipelines.stages.partition`). Not counted: ZeRO's
`parameter_alignment` padding (off by default) and ZeRO-3's gather buffers; the plan says ZeRO-3
figures are the partition only.
"""

import functools
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Optional

import torch
from deepspeed.runtime import utils as ds_utils

from megamamba.config import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import EMBEDDING, layer_arguments, layer_class, layer_kinds, layer_of
from megamamba.optim import decays
from megamamba.parallel import TensorParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel, holds_split_experts
from megamamba.pipelines.config.layout import Layout, zero_stage
from megamamba.pipelines.memory.activations import stage_activation_bytes
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION, imbalance, own_bounds, stage_costs
from megamamba.pipelines.stages.pipeline_module import layer_specs

FLOAT32 = 4
ZERO_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat groups are padded to 2 x dp elements
DEFAULT_BUCKET = int(5e8)  # DeepSpeed's reduce_bucket_size and non-ZeRO all-reduce bucket (elements)
GiB = 2**30


@dataclass(frozen=True)
class RunShape:
    """What the plan reads: the model, the layout and the settings that change what a rank holds."""

    model: MambaConfig
    layout: Layout
    seq_length: int  # of the sequence slice a rank holds: seq / cp under context parallelism
    zero_stage: int = 0
    partition_method: str = DEFAULT_PARTITION
    checkpoint_interval: int = 0
    sequence_parallel: bool = False
    autocast: bool = False
    reduce_bucket_size: int = DEFAULT_BUCKET
    overlap_comm: bool = False
    contiguous_gradients: bool = True

    @classmethod
    def of_run(
        cls,
        model: MambaConfig,
        layout: Layout,
        engine_config: dict,
        seq_length: int,
        partition_method: str,
        checkpoint_interval: int,
        sequence_parallel: bool,
    ) -> "RunShape":
        """The shape of a run from the dict handed to deepspeed.initialize (`pipelines.config.layout.engine_config`)."""
        zero = engine_config.get("zero_optimization", {})
        stage = zero_stage(engine_config)
        return cls(
            model,
            layout,
            seq_length,
            stage,
            partition_method,
            checkpoint_interval,
            sequence_parallel,
            autocast=engine_config.get("torch_autocast", {}).get("enabled", False),
            reduce_bucket_size=int(zero.get("reduce_bucket_size", DEFAULT_BUCKET)),
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        )

    def changed(self, **changes) -> "RunShape":
        return replace(self, **changes)


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage `stage` holds."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.activations


@dataclass(frozen=True)
class MemoryPlan:
    shape: RunShape
    stages: tuple
    bounds: tuple  # each stage's first layer of the layer list, and the end

    @property
    def worst(self) -> StageMemory:
        """The stage whose ranks need the most: it decides whether the run fits."""
        return max(self.stages, key=lambda s: s.total)


def _fake_tp(tp_size: int, sequence_parallel: bool) -> Optional[TensorParallel]:
    """Rank 0 of a TP group of `tp_size`, for building shards on the meta device (no collective runs)."""
    return (
        TensorParallel(group=object(), size=tp_size, rank=0, sequence_parallel=sequence_parallel)
        if tp_size > 1
        else None
    )


def _fake_ep(ep_size: int) -> Optional[ExpertParallel]:
    """Rank 0 of an expert-parallel group of `ep_size`, for building its experts on the meta device."""
    return ExpertParallel(group=object(), size=ep_size, rank=0) if ep_size > 1 else None  # type: ignore[arg-type]


def _groups(module: torch.nn.Module) -> tuple:
    """(decayed, not decayed, split experts) parameter counts of a module, as the trainer groups them for its
    optimizer (`megamamba.optim.param_groups`, the split experts in a group of their own)."""
    params = [p for p in module.parameters() if p.requires_grad]
    dense = [p for p in params if not holds_split_experts(p)]
    return (
        sum(p.numel() for p in dense if decays(p)),
        sum(p.numel() for p in dense if not decays(p)),
        sum(p.numel() for p in params if holds_split_experts(p)),
    )


def layer_parameters(model: MambaConfig, tp_size: int, sequence_parallel: bool = False, ep_size: int = 1) -> list:
    """(decayed, not decayed, split experts) parameters of TP rank 0 (and expert-parallel rank 0) for each
    pipeline layer: embedding, blocks, final norm, head (a tied head holds the embedding's weight)."""
    config_json = json.dumps(model.to_dict(), sort_keys=True)
    return list(_layer_parameters(config_json, tp_size, sequence_parallel, ep_size))


@functools.lru_cache(maxsize=64)
def _layer_parameters(config_json: str, tp_size: int, sequence_parallel: bool, ep_size: int) -> tuple:
    """`layer_parameters` of a config given as its JSON: built once per (config, tp, sp, ep), as plans repeat
    them."""
    model = MambaConfig.from_dict(json.loads(config_json))
    tp, ep = _fake_tp(tp_size, sequence_parallel), _fake_ep(ep_size)
    kinds = layer_kinds(model)
    counts = {}
    with torch.device("meta"):  # one layer of each kind built
        for kind in set(kinds):
            index = kinds.index(kind)
            counts[kind] = _groups(layer_class(model, index, tp)(model, **layer_arguments(model, index, tp, None, ep)))
    embedding = kinds[layer_of(EMBEDDING, model)]  # whose weight a tied head reads
    return tuple(counts[embedding] if layer_type(kind).tied(model) else counts[kind] for kind in kinds)


def stage_bounds(
    model: MambaConfig, pp: int, partition_method: str, counts: list, tp_size: int, seq_length: int
) -> list:
    """The first layer of each stage and the end, as the pipeline module partitions the layers (sequences of
    `seq_length` tokens, the whole sequence under context parallelism)."""
    own = own_bounds(model, pp, partition_method, seq_length)
    if own is not None:
        return own
    if partition_method == "uniform":
        return ds_utils.partition_uniform(num_items=len(counts), num_parts=pp)
    if partition_method == "parameters":
        return ds_utils.partition_balanced(weights=[sum(c) for c in counts], num_parts=pp)
    pattern = re.compile(partition_method.split(":", 1)[1], re.IGNORECASE)
    names = [spec.typename.__name__ for spec in layer_specs(model, _fake_tp(tp_size, False))]
    return ds_utils.partition_balanced(weights=[1 if pattern.search(n) else 0 for n in names], num_parts=pp)


def _padded(numel: int, dp: int) -> int:
    """A ZeRO group's flat size: padded to a multiple of ZERO_ALIGNMENT x dp elements."""
    alignment = ZERO_ALIGNMENT * dp
    return math.ceil(numel / alignment) * alignment


def _stage_state(groups: list, shape: RunShape) -> tuple:
    """(parameters, gradients, optimizer state) bytes of a rank whose stage holds `groups`: (elements, ranks its
    ZeRO partition spans) of each optimizer group."""
    stage = shape.zero_stage
    numel = sum(n for n, _ in groups)
    partition = sum(_padded(n, ranks) // ranks for n, ranks in groups if n)
    if stage == 0:
        return FLOAT32 * numel, FLOAT32 * numel, 2 * FLOAT32 * numel
    flat = sum(_padded(n, ranks) for n, ranks in groups if n)
    if stage == 3:  # the float32 parameter partition is the master copy
        return FLOAT32 * partition, FLOAT32 * partition, 2 * FLOAT32 * partition
    gradients = FLOAT32 * (numel if stage == 1 else partition)
    return FLOAT32 * flat, gradients, 3 * FLOAT32 * partition


def _buffers(numel: int, shape: RunShape) -> int:
    """DeepSpeed's gradient communication buffers (estimate; see the module docstring)."""
    if shape.zero_stage == 0:
        return FLOAT32 * min(numel, DEFAULT_BUCKET) if shape.layout.dp * shape.layout.cp > 1 else 0
    if not shape.contiguous_gradients:
        return 0
    copies = (2 if shape.overlap_comm else 1) + (1 if shape.layout.pp > 1 else 0)
    return FLOAT32 * shape.reduce_bucket_size * copies


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: DeepSpeed's 1F1B keeps pp - stage (at most
    the accumulation steps); the plain engine finishes each micro-batch's backward before the next."""
    return 1 if layout.pp == 1 else min(layout.pp - stage, layout.grad_accum)


def plan_memory(shape: RunShape) -> MemoryPlan:
    """Every stage's memory for `shape` (host arithmetic and meta-device modules only)."""
    model, layout = shape.model, shape.layout
    counts = layer_parameters(model, layout.tp, shape.sequence_parallel, layout.ep)
    data_axis = layout.dp * layout.cp  # ZeRO shards over DeepSpeed's data axis, split experts over 1 / ep of it
    bounds = stage_bounds(model, layout.pp, shape.partition_method, counts, layout.tp, shape.seq_length * layout.cp)
    last_layer = len(counts) - 1
    stages = []
    for stage in range(layout.pp):
        start, stop = bounds[stage], bounds[stage + 1]
        layers = list(range(start, stop))
        held = layers
        if model.tie_embeddings and layout.pp == 1:
            held = layers[:-1]  # one module holds the tied embedding and head
        groups = [sum(counts[i][g] for i in held) for g in (0, 1, 2)]
        ranks = (data_axis, data_axis, data_axis // layout.ep)
        parameters, gradients, optimizer = _stage_state(list(zip(groups, ranks)), shape)
        activations = stage_activation_bytes(
            RankShape(
                model=model,
                micro_batch_size=layout.micro_batch_size,
                seq_length=shape.seq_length * layout.cp,
                tp=layout.tp,
                cp=layout.cp,
                sequence_parallel=shape.sequence_parallel,
                act=2 if shape.autocast else 4,
            ),
            first_layer=start,
            stop_layer=stop,
            last_layer=last_layer,
            checkpoint_interval=shape.checkpoint_interval,
            in_flight=in_flight(layout, stage),
        )
        stages.append(StageMemory(stage, parameters, gradients, optimizer, _buffers(sum(groups), shape), activations))
    return MemoryPlan(shape, tuple(stages), tuple(int(b) for b in bounds))


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def plan_lines(plan: MemoryPlan) -> list:
    """Global rank 0's lines for the plan: the worst rank's breakdown, what the estimate assumed, the stages."""
    shape, worst = plan.shape, plan.worst
    layout = shape.layout
    zero = f"ZeRO {shape.zero_stage}" + (" partition only" if shape.zero_stage == 3 else "")
    recompute = f"recompute every {shape.checkpoint_interval} layers" if shape.checkpoint_interval else "no recompute"
    stages = ""
    if layout.pp > 1:
        costs = stage_costs(shape.model, list(plan.bounds), shape.seq_length * layout.cp)
        stages = (
            " | stages (layers: GiB) "
            + ", ".join(f"{a}-{b - 1}: {gib(s.total)}" for s, a, b in zip(plan.stages, plan.bounds, plan.bounds[1:]))
            + f"; the costliest stage does {imbalance(costs):.2f} x the mean stage's forward FLOPs"
        )
    return [
        f"memory plan, GiB per rank of stage {worst.stage} (the largest): parameters {gib(worst.parameters)}, "
        f"gradients {gib(worst.gradients)}, optimizer state {gib(worst.optimizer)} ({zero}, dp {layout.dp}"
        f"{f' x cp {layout.cp}' if layout.cp > 1 else ''}) | "
        f"estimated: DeepSpeed buffers {gib(worst.buffers)}, activations {gib(worst.activations)} | "
        f"total {gib(worst.total)}",
        f"  activations: micro batch {layout.micro_batch_size} x seq {shape.seq_length}, "
        f"{in_flight(layout, worst.stage)} in flight, "
        f"{recompute}, {'bf16 autocast' if shape.autocast else 'float32'}{stages}",
    ]
