"""Every plan for a model on N GPUs: (dp, cp, tp, pp, ZeRO stage, micro-batch, accumulation, recompute, and
for a model with mixture-of-experts layers the expert-parallel size), its memory from the start-up plan and its
predicted step time, the feasible ones ranked, and why each rejected layout family (dp, cp, tp, pp) was
rejected.

Tensor parallelism stays inside a node and runs with sequence parallelism; TP, CP and EP sizes are powers of
two. Settings the user fixed (`Request.fixed`) are kept; the search fills in the rest.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megamamba.config import MambaConfig
from megamamba.errors import LayoutError, MegamambaError
from megamamba.model.flops import training_flops_per_token
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import check_layout, conv_width, layer_kinds
from megamamba.parallel.context.context_parallel import check_context_layout
from megamamba.pipelines.config.layout import Layout, engine_config
from megamamba.pipelines.memory.fit import RESERVED
from megamamba.pipelines.memory.plan import RunShape, StageMemory, plan_memory
from megamamba.pipelines.planner.layer_costs import loss_work
from megamamba.pipelines.planner.profile import Profile
from megamamba.pipelines.planner.step_time import (
    Grid,
    StepTime,
    collective_seconds,
    data_parallel_seconds,
    layer_time,
    optimizer_seconds,
    stage_time,
)
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION, check_pattern_stages

MFU_MARGIN = 0.05  # a predicted MFU more than this above the best measured one is an extrapolation
FIXABLE = ("dp", "cp", "tp", "pp", "ep", "zero_stage", "micro_batch_size", "recompute")


class PlanError(MegamambaError, ValueError):
    """A request no plan can satisfy; the message names the nearest thing that would work."""


@dataclass(frozen=True)
class Request:
    model: MambaConfig
    gpus: int
    gpus_per_node: int
    seq_length: int
    global_batch_size: int
    device_memory: int
    autocast: bool = True
    fixed: dict = field(default_factory=dict)  # name in FIXABLE -> value the user set


@dataclass(frozen=True)
class Plan:
    dp: int
    cp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch_size: int
    grad_accum: int
    recompute: bool
    memory: StageMemory  # the rank that needs the most
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def family(self) -> tuple:
        return self.dp, self.cp, self.tp, self.pp


# How close a rejected family came, nearest first: its plans ran out of memory; a setting the user fixed rules it
# out; the global batch does not split over its dp; the model or sequence cannot run its layout; TP across nodes.
MEMORY, FIXED_SETTING, BATCH_SPLIT, LAYOUT_RULE, ACROSS_NODES = range(5)


@dataclass(frozen=True)
class Rejection:
    family: str  # "dp D x cp C x tp T x pp P"
    reason: str
    smallest_bytes: Optional[int] = None  # when nothing of the family fits: its smallest plan's need
    distance: int = LAYOUT_RULE  # how close it came: MEMORY (nearest) to ACROSS_NODES


@dataclass(frozen=True)
class Search:
    plans: list  # feasible, fastest first
    rejected: list  # Rejection, one per family
    request: Request
    measured_mfu: Optional[float] = None  # the best MFU a training run measured on the profile's GPU


def _powers_of_two(limit: int) -> list:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def label(dp: int, cp: int, tp: int, pp: int) -> str:
    return f"dp {dp} x cp {cp} x tp {tp} x pp {pp}"


def _layout_problem(request: Request, cp: int, tp: int, pp: int) -> Optional[str]:
    """Why (cp, tp, pp) cannot run this model and sequence at all, or None."""
    model = request.model
    if tp > request.gpus_per_node:
        return f"tp {tp} would span nodes of {request.gpus_per_node} GPUs: use tp {request.gpus_per_node} or less"
    try:
        check_layout(model, tp)
        check_context_layout(request.seq_length, cp, conv_width(model), tp, tp > 1)
        check_pattern_stages(model, pp)
    except LayoutError as e:
        return str(e)
    if request.seq_length % tp:
        return f"sequence parallelism needs seq {request.seq_length} divisible by tp {tp}"
    if model.n_layer < pp:
        return f"n_layer {model.n_layer} < pp {pp}: every stage needs a block"
    return None


def run_shape(
    request: Request, dp: int, cp: int, tp: int, pp: int, zero: int, micro: int, recompute: bool, ep: int = 1
) -> RunShape:
    """The start-up memory plan's view of a plan (sequence parallelism with TP, recompute every layer), read
    from the engine config start-up would hand DeepSpeed (ZeRO's defaults, overlap_comm on for stage 3)."""
    layout = Layout(request.gpus, dp, tp, pp, micro, request.global_batch_size // (micro * dp), cp, ep)
    ds_config = {"zero_optimization": {"stage": zero}, "bf16": {"enabled": request.autocast}}
    return RunShape.of_run(
        request.model,
        layout,
        engine_config(ds_config, layout, None, tp > 1),
        request.seq_length // cp,
        DEFAULT_PARTITION,
        1 if recompute else 0,
        tp > 1,
    )


def _step_time(
    request: Request, shape: RunShape, bounds: list, memory: list, grid: Grid, profile: Profile, recompute: bool
) -> StepTime:
    layout = shape.layout
    rank = RankShape(
        request.model,
        layout.micro_batch_size,
        request.seq_length,
        grid.tp,
        grid.cp,
        shape.sequence_parallel,
        2 if request.autocast else 4,
        grid.ep,
    )
    kinds = layer_kinds(request.model)
    per_kind = {kind: layer_time(kind, layer_type(kind).work(rank), grid, profile, recompute) for kind in set(kinds)}
    loss = layer_time("loss", loss_work(rank), grid, profile, recompute=False)  # on the last stage, after its layers
    stages = [
        stage_time(
            [per_kind[kinds[i]] for i in range(bounds[s], bounds[s + 1])] + [loss] * (s == grid.pp - 1),
            rank,
            grid,
            profile,
            (s > 0) + (s < grid.pp - 1),
            shape.zero_stage,
        )
        for s in range(grid.pp)
    ]
    slowest = max(stages, key=lambda t: t.total)
    m = layout.grad_accum
    reductions = []
    for s, stage in enumerate(memory):
        full = stage.parameters * (grid.dp * grid.cp if shape.zero_stage == 3 else 1)
        held = full // (grid.dp * grid.cp) if shape.zero_stage >= 1 else full
        reductions.append(
            (
                data_parallel_seconds(full, shape.zero_stage, grid, profile, m, stages[s], bounds[s + 1] - bounds[s]),
                optimizer_seconds(held // 4, profile),
            )
        )
    data, optimizer = max(reductions, key=sum)
    if request.model.tie_embeddings and grid.pp > 1:  # the tied weight's gradient, summed by first and last stage
        tied = request.model.padded_vocab_size * request.model.d_model * 4 // grid.tp
        data += collective_seconds("all_reduce", tied, 2, grid.link(profile, "pp"))
    return StepTime(
        m * slowest.compute,
        m * slowest.tp_comm,
        m * slowest.cp_comm,
        m * slowest.sends,
        (grid.pp - 1) * slowest.total,
        data,
        optimizer,
        m * slowest.overhead + profile.engine_cost(shape.zero_stage).step_s,
        m * slowest.ep_comm,
    )


def check_request(request: Request) -> None:
    """Refuse numbers no plan can use, naming the nearest that would work."""
    for name in ("gpus", "gpus_per_node", "seq_length", "global_batch_size"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name.replace('_', '-')} {value!r}: must be a positive integer")
    if request.gpus_per_node > request.gpus:
        raise PlanError(
            f"--gpus-per-node {request.gpus_per_node} is more than --gpus {request.gpus}: use "
            f"--gpus-per-node {request.gpus} (one node) or --gpus a multiple of {request.gpus_per_node}"
        )
    if request.gpus % request.gpus_per_node:
        below = request.gpus // request.gpus_per_node * request.gpus_per_node
        raise PlanError(
            f"--gpus {request.gpus} is not a whole number of nodes of {request.gpus_per_node}: use --gpus "
            f"{below} or {below + request.gpus_per_node}"
        )
    if request.device_memory <= RESERVED:
        raise PlanError(
            f"GPU memory {request.device_memory / 2**30:.1f} GiB leaves nothing after the "
            f"{RESERVED / 2**30:.0f} GiB reserved for the CUDA context and communication buffers"
        )
    unknown = sorted(set(request.fixed) - set(FIXABLE))
    if unknown:
        raise PlanError(f"cannot fix {unknown}; the planner chooses {FIXABLE}")


def _nothing_fits(result: "Search") -> PlanError:
    """The error for a search without a feasible plan: the closest family and what it lacks."""
    r = result.request
    sized = [x for x in result.rejected if x.smallest_bytes is not None]
    if sized:
        closest = min(sized, key=lambda x: x.smallest_bytes)
        need = (closest.smallest_bytes + RESERVED) / 2**30
        gpus = f"{r.gpus} GPU{'s' if r.gpus > 1 else ''}"
        return PlanError(
            f"no plan fits {gpus} of {r.device_memory / 2**30:.1f} GiB: the closest, "
            f"{closest.family}, {closest.reason}; GPUs of {need:.0f} GiB, or more GPUs, would fit it"
        )
    if (
        not any(r.gpus % d == 0 and r.global_batch_size % d == 0 for d in range(2, r.gpus + 1))
        and r.global_batch_size < r.gpus
    ):
        return PlanError(
            f"global batch {r.global_batch_size} splits over no data-parallel size of {r.gpus} GPUs "
            f"but 1: use a multiple of {r.gpus}"
        )
    nearest = sorted(result.rejected, key=lambda x: x.distance)
    reasons = "; ".join(list(dict.fromkeys(x.reason for x in nearest))[:3])
    if nearest and nearest[0].distance < LAYOUT_RULE:
        settings = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in r.fixed.items())
        fixed = f" with {settings}" if settings else ""
        return PlanError(f"no plan for {r.gpus} GPUs{fixed}: {reasons}")
    return PlanError(f"no layout of {r.gpus} GPUs can run this model and sequence: {reasons}")


def search(request: Request, profile: Profile) -> Search:
    """Every feasible plan, fastest first, and the rejected families; PlanError when there is none."""
    check_request(request)
    fixed, usable = request.fixed, request.device_memory - RESERVED
    tokens = request.global_batch_size * request.seq_length
    flops_per_token = training_flops_per_token(request.model, request.seq_length)
    plans, rejected = [], []
    node = request.gpus_per_node
    if request.gpus > node and "tp" not in fixed:
        rejected.append(
            Rejection(f"tp > {node}", f"tensor parallelism stays inside a node of {node} GPUs", distance=ACROSS_NODES)
        )
    for tp in _powers_of_two(min(request.gpus, max(node, fixed.get("tp", node)))):
        for cp in _powers_of_two(request.gpus // tp):
            for pp in range(1, request.gpus // (tp * cp) + 1):
                if request.gpus % (tp * cp * pp):
                    continue
                dp = request.gpus // (tp * cp * pp)
                family = dict(dp=dp, cp=cp, tp=tp, pp=pp)
                if any(fixed.get(k, v) != v for k, v in family.items()):
                    continue
                problem, distance = _layout_problem(request, cp, tp, pp), LAYOUT_RULE
                if problem is None and request.global_batch_size % dp:
                    problem = f"global batch {request.global_batch_size} is not divisible by dp {dp}"
                    distance = BATCH_SPLIT
                if problem is not None:
                    rejected.append(Rejection(label(dp, cp, tp, pp), problem, distance=distance))
                    continue
                grid = Grid(dp, cp, tp, pp, request.gpus_per_node)
                found, closest = _family_plans(request, profile, grid, usable, tokens, flops_per_token)
                plans += found
                if closest is not None:
                    rejected.append(closest)
    plans.sort(key=lambda p: (p.time.total, p.memory.total))
    result = Search(plans, rejected, request, profile.measured_mfu)
    if not plans:
        raise _nothing_fits(result)
    return result


def _family_plans(
    request: Request, profile: Profile, grid: Grid, usable: int, tokens: int, flops_per_token: int
) -> tuple:
    """(feasible plans of the family, its Rejection when none is)."""
    fixed, dp = request.fixed, grid.dp
    per_replica = request.global_batch_size // dp
    micros = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and fixed.get("micro_batch_size", m) == m]
    # ZeRO-3 only when asked for: the memory plan counts its partition, not its gathered and prefetched parameters
    stages = [0, 1] if grid.pp > 1 else [0, 1, 2, 3 if fixed.get("zero_stage") == 3 else 2]
    zeros = sorted({z for z in stages if fixed.get("zero_stage", z) == z})
    family = label(grid.dp, grid.cp, grid.tp, grid.pp)
    eps = _expert_parallel_sizes(request, grid)
    if not eps:
        return [], Rejection(
            family,
            f"ep {fixed['ep']}: the expert-parallel size must divide dp x cp = {grid.dp * grid.cp} and the "
            "experts of a model with mixture-of-experts layers",
            distance=FIXED_SETTING,
        )
    if not zeros:
        return [], Rejection(
            family,
            f"ZeRO stage {fixed['zero_stage']} with pp {grid.pp}: DeepSpeed's pipeline engine runs ZeRO 0 or 1 only",
            distance=FIXED_SETTING,
        )
    if not micros:
        return [], Rejection(
            family,
            f"micro batch {fixed['micro_batch_size']} does not divide the {per_replica} "
            f"sequences per replica of dp {dp}",
            distance=FIXED_SETTING,
        )
    plans, smallest = [], None
    for ep in eps:
        on_grid = dataclasses.replace(grid, ep=ep)
        for zero in [z for z in zeros if ep == 1 or z < 3]:  # expert parallelism runs with ZeRO 0-2
            for recompute in [r for r in (False, True) if fixed.get("recompute", r) == r]:
                for micro in micros:
                    shape = run_shape(request, dp, grid.cp, grid.tp, grid.pp, zero, micro, recompute, ep)
                    memory = plan_memory(shape)
                    worst = memory.worst
                    if worst.total > usable:
                        if smallest is None or worst.total < smallest[0]:
                            smallest = (worst.total, zero, micro, recompute, ep)
                        continue
                    bounds, stages_memory = list(memory.bounds), list(memory.stages)
                    time = _step_time(request, shape, bounds, stages_memory, on_grid, profile, recompute)
                    rate = tokens / time.total / request.gpus
                    plans.append(
                        Plan(
                            dp,
                            grid.cp,
                            grid.tp,
                            grid.pp,
                            zero,
                            micro,
                            shape.layout.grad_accum,
                            recompute,
                            worst,
                            time,
                            rate,
                            rate * flops_per_token / profile.mfu_flops_per_s,
                            ep,
                            shape.sequence_parallel,
                        )
                    )
    if plans:
        return plans, None
    if smallest is None:  # ZeRO-3 fixed with expert parallelism fixed
        return [], Rejection(family, "expert parallelism runs with ZeRO 0, 1 or 2", distance=FIXED_SETTING)
    total, zero, micro, recompute, ep = smallest
    experts = f", ep {ep}" if request.model.has_moe_layers else ""
    return [], Rejection(
        family,
        f"does not fit: at best {total / 2**30:.1f} GiB per GPU (ZeRO {zero}, micro batch "
        f"{micro}, recompute {'on' if recompute else 'off'}{experts}), {(total - usable) / 2**30:.1f} "
        f"GiB over the {usable / 2**30:.1f} GiB usable",
        total,
        MEMORY,
    )


def _expert_parallel_sizes(request: Request, grid: Grid) -> list:
    """The expert-parallel sizes a family can take: powers of two dividing its dp x cp ranks and the experts (1
    for a model without MoE layers), as fixed."""
    data_axis = grid.dp * grid.cp
    if request.model.has_moe_layers:
        experts = request.model.moe_options.num_experts
        sizes = [e for e in _powers_of_two(data_axis) if data_axis % e == 0 and experts % e == 0]
    else:
        sizes = [1]
    return [e for e in sizes if request.fixed.get("ep", e) == e]
