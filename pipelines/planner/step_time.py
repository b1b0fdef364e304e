"""The predicted time of one optimizer step of a plan, split into where it goes.

Per micro-batch, each stage runs its layers' kernels (a kernel takes its launch time, then its FLOPs at
the matmul rate or its bytes at the copy bandwidth, whichever is longer, over its kind's efficiency; its
backward is its kind's ratio of that; a measured profile maps a layer's kernel time to its measured time
by a fixed cost and a scale per layer kind) and their TP, CP and EP collectives (a ring on the slowest link
the group spans: alpha per step plus bytes over bandwidth, less the compute a collective overlaps: the
column-parallel projections' gathers and input gradients; a measured profile adds a cost per call);
recomputation runs every forward twice.
A measured profile adds the engine's fixed cost per micro-batch and per step. DeepSpeed's 1F1B
schedule takes (m + p - 1) times the slowest stage for m micro-batches on p stages, the bubble being
p - 1 of them. Then DeepSpeed's data-parallel traffic (`data_parallel_seconds`), the tied embedding's
all-reduce between the first and last stage, and the optimizer's pass over this rank's state.
"""

from dataclasses import dataclass

from megamamba.model.layer_types.costs import Collective, LayerWork, RankShape
from megamamba.pipelines.planner.layer_costs import boundary_bytes
from megamamba.pipelines.planner.profile import Link, Profile


@dataclass(frozen=True)
class Grid:
    """The process grid and where its groups sit: ranks are numbered TP fastest, then CP, DP, PP."""

    dp: int
    cp: int
    tp: int
    pp: int
    gpus_per_node: int
    ep: int = 1  # consecutive ranks of the data axis

    def spans_nodes(self, stride: int, size: int) -> bool:
        return size > 1 and stride * size > self.gpus_per_node

    def link(self, profile: Profile, group: str) -> Link:
        stride, size = {
            "tp": (1, self.tp),
            "cp": (self.tp, self.cp),
            "ep": (self.tp, self.ep),
            "data": (self.tp, self.dp * self.cp),
            "pp": (self.tp * self.cp * self.dp, self.pp),
        }[group]
        return profile.links["inter_node" if self.spans_nodes(stride, size) else "intra_node"]

    def size(self, group: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "data": self.dp * self.cp, "pp": self.pp}[group]

    def compute_scale(self, profile: Profile) -> float:
        """The profile's multiple of its layer fits for a layer of this grid's step."""
        shared = min(self.dp * self.cp * self.tp * self.pp, self.gpus_per_node) > 1
        return profile.model_scale * (profile.shared_node_scale if shared else 1.0)


def collective_seconds(kind: str, nbytes: float, size: int, link: Link) -> float:
    """A ring all-reduce, all-gather or reduce-scatter over `size` ranks, an all-to-all (each rank sends all but
    its own share of `nbytes`), or one send."""
    if kind == "send":
        return link.alpha_s + nbytes / link.bytes_per_s
    if size == 1:
        return 0.0
    steps = size - 1
    factor = 2 if kind == "all_reduce" else 1
    return factor * (steps * link.alpha_s + steps / size * nbytes / link.bytes_per_s)


def kernel_seconds(kind: str, flops: float, nbytes: float, profile: Profile) -> float:
    """A kernel's forward: its kind's fixed cost (or the launch), then its FLOPs or bytes at the roofline over
    its kind's efficiency."""
    roofline = max(flops / profile.matmul_flops_per_s, nbytes / profile.copy_bytes_per_s)
    kernel = profile.kernel(kind)
    return (profile.launch_s if kernel.fixed_s is None else kernel.fixed_s) + roofline / kernel.efficiency


@dataclass(frozen=True)
class StageTime:
    """One micro-batch's forward and backward on one stage, in seconds (`forward`: the compute of its first
    forward, part of `compute`; `overhead`: the engine's calls around them)."""

    compute: float
    tp_comm: float
    cp_comm: float
    sends: float
    forward: float = 0.0
    overhead: float = 0.0
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.sends + self.overhead


def _collective(c: Collective, grid: Grid, profile: Profile) -> float:
    return collective_seconds(c.kind, c.nbytes, grid.size(c.group), grid.link(profile, c.group))


def kernel_seconds_of(work: LayerWork, profile: Profile) -> tuple:
    """(forward, backward) seconds of a layer's kernels alone: the backward is each kernel's forward times its
    kind's backward ratio, plus the forward again for a kernel recomputed in the backward."""
    forward = backward = 0.0
    for k in work.kernels:
        seconds = kernel_seconds(k.kind, k.flops, k.bytes, profile)
        forward += seconds
        backward += seconds * (profile.kernel(k.kind).backward_ratio + k.checkpointed)
    return forward, backward


def layer_time(kind: str, work: LayerWork, grid: Grid, profile: Profile, recompute: bool) -> StageTime:
    """One layer of `kind` (a profile layer kind) forward and backward for one micro-batch: its kernels through
    the profile's fit of that kind and its scales for this grid (recomputation: its forward twice); a
    collective costs what outlasts the compute it overlaps."""
    kernels_forward, kernels_backward = kernel_seconds_of(work, profile)
    fit, scale = profile.layer(kind), grid.compute_scale(profile)
    forward = scale * (fit.forward_fixed_s + fit.forward_scale * kernels_forward)
    compute = forward * (1 + recompute) + scale * (fit.backward_fixed_s + fit.backward_scale * kernels_backward)
    comm = {"tp": 0.0, "cp": 0.0, "ep": 0.0}
    for c in work.collectives:
        hidden = (
            c.share * kernel_seconds(c.overlaps.kind, c.overlaps.flops, c.overlaps.bytes, profile)
            if c.overlaps is not None and profile.overlap
            else 0.0
        )
        seconds = max(0.0, _collective(c, grid, profile) - hidden) + profile.collective_call_s.get(c.group, 0.0)
        seconds *= 2 if recompute and not c.backward else 1
        comm[c.group] += seconds
    return StageTime(compute, comm["tp"], comm["cp"], 0.0, forward, ep_comm=comm["ep"])


def stage_time(layers: list, shape: RankShape, grid: Grid, profile: Profile, sends: int, zero_stage: int) -> StageTime:
    """A stage of `layers` (each its `layer_time`), sending `sends` boundaries (0, 1 or 2) per micro-batch,
    with the engine's cost per micro-batch at `zero_stage`."""
    boundary = collective_seconds("send", boundary_bytes(shape), 2, grid.link(profile, "pp"))
    return StageTime(
        sum(t.compute for t in layers),
        sum(t.tp_comm for t in layers),
        sum(t.cp_comm for t in layers),
        2 * sends * boundary,
        sum(t.forward for t in layers),
        profile.engine_cost(zero_stage).micro_batch_s,
        sum(t.ep_comm for t in layers),
    )


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by where they go."""

    compute: float
    tp_comm: float
    cp_comm: float
    pipeline_sends: float
    bubble: float
    data_parallel: float
    optimizer: float
    overhead: float  # the engine's, per micro-batch and per step
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tp_comm
            + self.cp_comm
            + self.ep_comm
            + self.pipeline_sends
            + self.bubble
            + self.data_parallel
            + self.optimizer
            + self.overhead
        )


def data_parallel_seconds(
    parameter_bytes: int,
    zero_stage: int,
    grid: Grid,
    profile: Profile,
    micro_batches: int,
    stage: StageTime,
    layers: int = 1,
) -> float:
    """Exposed seconds of DeepSpeed 0.19.8's data-parallel traffic over dp x cp ranks for a stage holding
    `parameter_bytes` of float32 parameters (gradients reduced in float32: `pipelines.config.layout`).

    ZeRO 0 all-reduces the gradients after the last backward. ZeRO 1 and 2 all-reduce the gradient
    buckets (`use_multi_rank_bucket_allreduce`, on by default; each rank keeps its partition) and
    all-gather the updated parameters after the step: ZeRO 1 at the accumulation boundary, ZeRO 2 in
    every micro-batch's backward, on the compute stream (`overlap_comm` defaults off below stage 3).
    The pipeline engine reduces after its last micro-batch. ZeRO 3, per micro-batch: the parameters
    all-gathered for the forward and again for the backward, the gradients reduce-scattered, on side
    streams with prefetch (overlap_comm on): exposed only where they outlast the compute they overlap
    (all of it where the profile does not overlap);
    each of the stage's `layers` is gathered by its own all-gather (at least: DeepSpeed fetches each
    submodule), each paying the ring's latency.
    """
    link, size = grid.link(profile, "data"), grid.size("data")
    reduce = collective_seconds("all_reduce", parameter_bytes, size, link)
    gather = collective_seconds("all_gather", parameter_bytes, size, link)
    if zero_stage == 0:
        return reduce
    if zero_stage < 3:
        return (micro_batches if zero_stage == 2 else 1) * reduce + gather
    gather += (layers - 1) * (size - 1) * link.alpha_s
    scatter = collective_seconds("reduce_scatter", parameter_bytes, size, link)
    if not profile.overlap:
        return micro_batches * (2 * gather + scatter)
    backward = stage.compute - stage.forward
    return micro_batches * (max(0.0, gather - stage.forward) + max(0.0, gather + scatter - backward))


def optimizer_seconds(state_parameters: int, profile: Profile) -> float:
    """AdamW over the parameters whose optimizer state this rank holds, and the gradient norm before it."""
    return profile.adamw.bytes_per_parameter * state_parameters / profile.copy_bytes_per_s / profile.adamw.efficiency
