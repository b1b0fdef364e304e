"""What launch/train.py tells its console: the start-up summary, step timing and optimizer-state lines.

Everything here is host arithmetic on values the run already has (no collectives, no device
reads): global rank 0 prints the lines, so a run's log says once what it will do (and which
formats its checkpoints export to), how far it is, and when it will end.
"""

import time
from typing import Optional, Sequence, Union

from megamamba.checkpoint.export_formats import exports_line
from megamamba.config import MambaConfig
from megamamba.data.training_data import BUILTIN_NAME, TrainingData
from megamamba.model.layer_types import LAYER_TYPES, layer_type
from megamamba.model.layers import layer_class, layer_kinds
from megamamba.schedule.lr_schedule import DeepSpeedSchedule, LRSchedule


def count_parameters(config: MambaConfig) -> int:
    """The whole model's parameters (padded vocabulary, a tied head counted once), built on the meta device."""
    kinds = layer_kinds(config)  # one layer of each kind built: a whole model on meta takes seconds at 1.3b
    per_kind = {
        kind: sum(p.numel() for p in layer_class(config, kinds.index(kind))(config, device="meta").parameters())
        for kind in set(kinds)
        if not layer_type(kind).tied(config)  # a tied head holds the embedding's weight
    }
    return sum(per_kind.get(kind, 0) for kind in kinds)


def _count(n: float) -> str:
    """1234567 -> '1.23M' (exact below 1000)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def data_lines(data: TrainingData, train_iters: int) -> list:
    """One line per training source (weight, tokens, epochs the run reads); a warning for the built-in corpus."""
    train = data.train
    samples = train_iters * train.global_batch_size
    lines = []
    for weight, packer in zip(train.schedule.weights, train.packers):
        dataset = packer.dataset
        epochs = float(weight) * samples / max(packer.samples_per_epoch, 1)
        lines.append(
            f"  data: {dataset.prefix} weight {float(weight):.3g} | {_count(dataset.num_tokens)} tokens, "
            f"{dataset.num_documents} docs | {epochs:.3g} epochs"
        )
    if any(p.dataset.prefix.startswith(BUILTIN_NAME) for p in train.packers):
        total = sum(p.dataset.num_tokens for p in train.packers)
        lines.append(
            f"train.py: warning: no --data: training on the built-in corpus ({_count(total)} tokens, a "
            "smoke test, not a training set); give --data PREFIX (see megamamba.data.preprocess)"
        )
    return lines


def _deepspeed_schedule(schedule) -> str:
    """What a DeepSpeed "scheduler" block adds to the LR line (nothing for the flags' schedule)."""
    if not isinstance(schedule, DeepSpeedSchedule):
        return ""
    return f" (DeepSpeed scheduler: {schedule.warmup_type} warm-up from {schedule.start:g})"


def startup_summary(
    *,
    model: MambaConfig,
    layout,
    seq_length: int,
    train_iters: int,
    schedule: Union[LRSchedule, DeepSpeedSchedule],
    engine_config: dict,
    data: TrainingData,
    total_params: int,
    stage_params: Sequence[int],
    save: Optional[str],
    load: Optional[str],
    save_interval: int,
    keep_last: Optional[int],
) -> list:
    """The lines global rank 0 prints once before the first step; stage_params: (min, max) over ranks."""
    tokens_per_step = layout.global_batch_size * seq_length
    low, high = stage_params
    per_rank = f"{low}" if low == high else f"{low}..{high}"
    autocast = engine_config.get("torch_autocast", {}).get("enabled", False)
    zero = engine_config.get("zero_optimization", {}).get("stage", 0)
    saving = (
        "no --save (nothing is saved)"
        if not save
        else (f"--save {save} every {save_interval or train_iters} steps, keep {keep_last or 'all'}")
    )
    return [
        f"run: {model.layer}, {_layers(model)}, d_model {model.d_model} | parameters {total_params} "
        f"({_count(total_params)}) total, {per_rank} per rank (this stage / TP shard)",
        f"  layout: world {layout.world_size} = dp {layout.dp}{_cp(layout, ' x cp {}')} x tp {layout.tp} "
        f"x pp {layout.pp} | micro batch "
        f"{layout.micro_batch_size} x grad accumulation {layout.grad_accum} x dp {layout.dp} = global batch "
        f"{layout.global_batch_size} x seq {seq_length} = {tokens_per_step} tokens per step",
        f"  length: {train_iters} steps = {train_iters * tokens_per_step} tokens "
        f"({_count(train_iters * tokens_per_step)})",
        *data_lines(data, train_iters),
        f"  lr: peak {schedule.peak:g}, min {schedule.minimum:g}, warm-up {schedule.warmup_iters} iters, "
        f"{schedule.decay_style} decay over {schedule.total_iters} iters{_deepspeed_schedule(schedule)}",
        f"  precision: {'bf16 autocast (float32 parameters and masters)' if autocast else 'float32'} "
        f"| ZeRO stage {zero}",
        f"  checkpoints: {saving} | --load {load or 'none (fresh start)'}",
        f"  {exports_line(model)}",
    ]


class StepClock:
    """Elapsed time since the job started and the ETA of the remaining steps, from host time only.

    The rate is measured from the end of this run's first step (which holds one-off work: optimizer
    state allocation, kernel compilation); right after that step, its own time is the estimate.
    """

    def __init__(self, job_start: float, loop_start: float, train_iters: int):
        self.job_start, self.train_iters = job_start, train_iters
        self._mark: Optional[tuple] = None  # (time, step) at the end of this run's first step
        self._loop_start = loop_start

    def step_done(self, step: int, now: Optional[float] = None) -> tuple:
        """(elapsed_s, eta_s) once `step` (0-based) has finished; call after every step."""
        now = time.perf_counter() if now is None else now
        if self._mark is None:
            self._mark = (now, step)
            per_step = now - self._loop_start
        else:
            per_step = (now - self._mark[0]) / (step - self._mark[1])
        return now - self.job_start, per_step * (self.train_iters - step - 1)


def optimizer_state_lines(layout, per_rank: Sequence[tuple]) -> list:
    """Global rank 0's lines for the optimizer state of every rank: (stage parameters, bytes) per rank,
    one line per distinct pair with the ranks holding it (one line when every rank holds the same)."""
    groups: dict = {}
    for rank, pair in enumerate(per_rank):
        groups.setdefault(pair, []).append(rank)
    lines = []
    for (params, state_bytes), ranks in groups.items():
        who = "every rank" if len(ranks) == len(per_rank) else "ranks " + _ranges(ranks)
        ranks_sharing = layout.dp * layout.cp  # ZeRO partitions over DeepSpeed's data axis, dp x cp ranks
        lines.append(
            f"optimizer state, {who}: dp={layout.dp}{_cp(layout, ' cp={}')} tp={layout.tp} pp={layout.pp}{_ep(layout)} "
            f"micro={layout.micro_batch_size} accum={layout.grad_accum} | stage parameters {params} | "
            f"optimizer state bytes {state_bytes} = {state_bytes * ranks_sharing / params:.3f} x stage "
            f"parameters / {_cp(layout, '(dp x cp)') or 'dp'}"
        )
    return lines


def _layers(model: MambaConfig) -> str:
    """'4 layers'; a hybrid's with its kinds counted: '5 layers (2 Mamba2, 1 attention, 2 MLP)', and
    '(..., an MLP in each)' for mamba_ssm's d_intermediate."""
    kinds = model.block_kinds
    counts = [f"{kinds.count(kind)} {t.label(model)}" for kind, t in LAYER_TYPES.items() if kind in kinds]
    inside = ", an MLP in each" if model.mlp_inside_blocks else ""
    return f"{model.n_layer} layers" + (f" ({', '.join(counts)}{inside})" if len(counts) > 1 or inside else "")


def _cp(layout, text: str) -> str:
    """`text` with the context-parallel size filled in, or "" without context parallelism."""
    return text.format(layout.cp) if layout.cp > 1 else ""


def _ep(layout) -> str:
    """' ep=E (experts partitioned over dp x cp / E ranks)' under expert parallelism, else ""."""
    return f" ep={layout.ep} (experts partitioned over dp x cp / {layout.ep} ranks)" if layout.ep > 1 else ""


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
