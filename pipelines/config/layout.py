"""The (dp, cp, tp, pp) layout of a run, with its expert-parallel size, and every consistency check that can fail
before training.

All checks read only the command line, the DeepSpeed JSON, the model config and the world size,
so a bad combination stops the job before any process group, model or optimizer exists; each
raises `LayoutError` with one message naming the values and the rule.

Rules that settle how our flags and the JSON interact (docs/training.md):
  - Batch: DeepSpeed's own keys. train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x dp, where dp = world / (cp x tp x pp); any two of the three fix
    the third, all three must agree. The cp ranks of a context-parallel group share their samples
    (each holds a slice of every sequence), so they count once.
  - Optimizer and learning-rate schedule: the JSON's "optimizer" (Adam/AdamW) and "scheduler"
    (WarmupLR, WarmupDecayLR, WarmupCosineLR) blocks or our flags, translated to torch's fused
    AdamW and our schedule (`pipelines.config.ds_translate`); DeepSpeed never sees the blocks.
  - Gradient clipping: the JSON's "gradient_clipping" or --clip-grad, not both; 1.0 if neither.
  - Precision: float32, or bf16 through "torch_autocast" (float32 parameters and master weights,
    bf16 matmuls). DeepSpeed's own bf16 mode would cast every parameter, the SSM's A_log, D and
    dt_bias included, to bf16: "bf16": {"enabled": true} is translated to torch_autocast bf16
    instead. "fp16" is refused (it needs loss scaling).
"""

import argparse
import json
from dataclasses import dataclass
from typing import Optional

from megamamba.config import MambaConfig
from megamamba.errors import LayoutError
from megamamba.model.layers import check_layout, conv_width
from megamamba.parallel.context.context_parallel import check_context_layout
from megamamba.parallel.expert.expert_parallel import check_expert_layout
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION, check_pattern_stages

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
DEFAULT_CLIP_GRAD = 1.0
TRANSLATED_BLOCKS = ("tensorboard", "optimizer", "scheduler", "bf16", "fp16")  # never handed to DeepSpeed


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    grad_accum: int
    cp: int = 1
    ep: int = 1  # expert-parallel size: ranks of the data x context axis sharing each MoE layer's experts

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp


@dataclass(frozen=True)
class LayoutFlags:
    """How a run is laid out as its flags say, or as --auto-parallel chose: the parallel sizes, sequence
    parallelism, the batch flags (None: the DeepSpeed JSON's), the ZeRO stage (None: the JSON's), the
    recomputation interval and the pipeline's partition method."""

    tp: int
    pp: int
    cp: int
    sequence_parallel: bool
    micro_batch_size: Optional[int]
    global_batch_size: Optional[int]
    zero_stage: Optional[int]
    checkpoint_interval: int
    partition_method: str
    ep: int = 1

    def with_batch(self, ds_config: dict) -> dict:
        """The JSON's batch keys and ZeRO stage with these flags applied; a flag disagreeing with the JSON is
        refused (LayoutError)."""
        config = dict(ds_config)
        for flag, key, value in (
            ("--micro-batch-size", "train_micro_batch_size_per_gpu", self.micro_batch_size),
            ("--global-batch-size", "train_batch_size", self.global_batch_size),
        ):
            if value is None:
                continue
            if config.get(key) is not None and config[key] != value:
                raise LayoutError(f"{flag} {value} disagrees with the DeepSpeed config's {key}={config[key]}; keep one")
            config[key] = value
        if self.zero_stage is not None:
            config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": self.zero_stage}
        return config


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name}={value!r}: must be a positive integer")
    return value


def resolve_layout(world_size: int, tp: int, pp: int, ds_config: dict, cp: int = 1, ep: int = 1) -> Layout:
    """dp from world / (cp x tp x pp); micro-batch and accumulation steps from the JSON's batch keys."""
    _positive("--tensor-parallel-size", tp)
    _positive("--pipeline-parallel-size", pp)
    _positive("--context-parallel-size", cp)
    _positive("--expert-model-parallel-size", ep)
    if world_size % (cp * tp * pp):
        what = "context x tensor x pipeline" if cp > 1 else "tensor x pipeline"
        sizes = f"{cp} x {tp} x {pp}" if cp > 1 else f"{tp} x {pp}"
        raise LayoutError(f"world size {world_size} is not a multiple of {what} parallel size {sizes} = {cp * tp * pp}")
    dp = world_size // (cp * tp * pp)
    given = {k: _positive(k, ds_config[k]) for k in BATCH_KEYS if ds_config.get(k) is not None}
    total = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    accum = given.get("gradient_accumulation_steps")
    if total is None and micro is None:
        raise LayoutError("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu")
    if total is None:
        accum = accum or 1
    elif micro is None:
        accum = accum or 1
        if total % (accum * dp):
            raise LayoutError(
                f"train_batch_size={total} is not divisible by gradient_accumulation_steps x data-parallel size "
                f"= {accum} x {dp}"
            )
        micro = total // (accum * dp)
    elif accum is None:
        if total % (micro * dp):
            raise LayoutError(
                f"train_batch_size={total} is not divisible by train_micro_batch_size_per_gpu x data-parallel size "
                f"= {micro} x {dp} (dp = world {world_size} / ({f'cp {cp} x ' if cp > 1 else ''}tp {tp} x pp {pp}))"
            )
        accum = total // (micro * dp)
    layout = Layout(world_size, dp, tp, pp, micro, accum, cp, ep)
    if total is not None and total != layout.global_batch_size:
        raise LayoutError(
            f"train_batch_size={total} != train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"data-parallel size = {micro} x {accum} x {dp} = {layout.global_batch_size}"
        )
    return layout


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def check_run(
    layout: Layout,
    ds_config: dict,
    model: MambaConfig,
    seq_length: int,
    sequence_parallel: bool,
    clip_grad: Optional[float],
) -> None:
    """Every rule between layout, DeepSpeed JSON, model and flags; raises LayoutError on the first broken one."""
    _positive("--seq-length", seq_length)
    stage = zero_stage(ds_config)
    if stage not in (0, 1, 2, 3):
        raise LayoutError(f"zero_optimization.stage={stage}: must be 0, 1, 2 or 3")
    if layout.pp > 1 and stage > 1:
        raise LayoutError(
            f"ZeRO stage {stage} with pipeline parallel size {layout.pp}: DeepSpeed's pipeline engine supports "
            "ZeRO stage 0 or 1 only (stages 2 and 3 need --pipeline-parallel-size 1)"
        )
    if model.n_layer < layout.pp:
        raise LayoutError(
            f"n_layer={model.n_layer} is smaller than pipeline parallel size {layout.pp}: every stage needs a block"
        )
    check_layout(model, layout.tp)
    check_pattern_stages(model, layout.pp)
    check_experts(layout, model, stage, ds_config)
    if sequence_parallel and layout.tp == 1:
        raise LayoutError("--sequence-parallel needs --tensor-parallel-size > 1 (it splits the sequence over TP ranks)")
    if sequence_parallel and seq_length % layout.tp:
        raise LayoutError(
            f"--seq-length {seq_length} is not divisible by tensor parallel size {layout.tp}, "
            "which sequence parallelism requires"
        )
    try:
        check_context_layout(seq_length, layout.cp, conv_width(model), layout.tp, sequence_parallel)
    except LayoutError as e:
        raise LayoutError(f"--seq-length {seq_length}: {e}") from None
    if clip_grad is not None and "gradient_clipping" in ds_config:
        raise LayoutError(
            f"gradient clipping set twice: --clip-grad {clip_grad} and the DeepSpeed config's "
            f"gradient_clipping={ds_config['gradient_clipping']}; keep one"
        )
    interval = ds_config.get("pipeline", {}).get("activation_checkpoint_interval")
    if interval is not None:
        raise LayoutError(
            f'"pipeline": {{"activation_checkpoint_interval": {json.dumps(interval)}}}: recomputation is ours, the '
            f"same at every pipeline size; use --checkpoint-activations-interval {interval} and remove the key"
        )
    if ds_config.get("fp16", {}).get("enabled", False):
        raise LayoutError(
            '"fp16": {"enabled": true}: float16 needs loss scaling, which we do not run; use "bf16": '
            '{"enabled": true} (translated to torch_autocast bf16, float32 parameters)'
        )
    bf16 = ds_config.get("bf16", {})
    if set(bf16) - {"enabled"} or bf16.get("enabled", False) not in (True, False):
        raise LayoutError(
            f'"bf16": {json.dumps(bf16)}: only "enabled": true/false is translated (to torch_autocast bf16); '
            "the other keys configure DeepSpeed's bf16 optimizer, which we do not use"
        )
    autocast = ds_config.get("torch_autocast", {})
    bf16_names = ("bfloat16", "bf16", "torch.bfloat16")
    if autocast.get("enabled", False) and autocast.get("dtype", "bfloat16") not in bf16_names:
        raise LayoutError(
            f"torch_autocast.dtype={autocast['dtype']!r}: only bfloat16 is supported (float16 needs loss scaling)"
        )
    if bf16.get("enabled", False) and autocast.get("enabled", True) is False:
        raise LayoutError('"bf16": {"enabled": true} and "torch_autocast": {"enabled": false} disagree; keep one')


def check_experts(layout: Layout, model: MambaConfig, stage: int, ds_config: dict) -> None:
    """The rules of expert parallelism: MoE layers to split, experts and data x context ranks it divides, and
    the ZeRO paths that reduce expert gradients over their own group (stages 0-2, reduce-scatter)."""
    if layout.ep == 1:
        return
    if not model.has_moe_layers:
        raise LayoutError(
            f"--expert-model-parallel-size {layout.ep}: the model has no mixture-of-experts layers (E) to split"
        )
    check_expert_layout(model.moe_options.num_experts, layout.ep, layout.dp * layout.cp)
    if stage == 3:
        raise LayoutError(
            f"--expert-model-parallel-size {layout.ep} with ZeRO stage 3: expert parallelism runs with ZeRO stage "
            "0, 1 or 2"
        )
    if stage and ds_config.get("zero_optimization", {}).get("reduce_scatter", True) is False:
        raise LayoutError(
            f"--expert-model-parallel-size {layout.ep} with zero_optimization.reduce_scatter false: DeepSpeed "
            "reduces expert gradients over their own group only by reduce-scatter; remove the key"
        )


def engine_config(ds_config: dict, layout: Layout, clip_grad: Optional[float], sequence_parallel: bool) -> dict:
    """The dict handed to deepspeed.initialize: batch keys resolved, clipping set, TensorBoard left to us.

    The "tensorboard" block is taken out (our metrics logger writes the event files, with our names),
    so are "optimizer" and "scheduler" (translated by `pipelines.config.ds_translate`: DeepSpeed gets a
    client optimizer) and "bf16"/"fp16" ("bf16" enabled becomes torch_autocast bf16);
    with sequence parallelism the boundary tensor differs per TP rank, so the pipeline must not
    partition it across the TP group (pipe_partitioned / grad_partitioned off). Unless the JSON
    says otherwise: DeepSpeed's throughput timer is off (it synchronizes the device at every
    forward and step), and under torch_autocast gradients are reduced in float32 at every layout
    (DeepSpeed would reduce those of exact nn.Linear modules in bf16: the single-device model's,
    not the tensor-parallel ones').
    """
    config = {k: v for k, v in ds_config.items() if k not in TRANSLATED_BLOCKS}
    config.setdefault("timers", {"throughput": {"enabled": False}})
    if ds_config.get("bf16", {}).get("enabled", False):
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", **config.get("torch_autocast", {})}
    if config.get("torch_autocast", {}).get("enabled", False):
        config["torch_autocast"] = {"lower_precision_safe_modules": [], **config["torch_autocast"]}
    config["train_batch_size"] = layout.global_batch_size * layout.cp  # DeepSpeed's data axis holds dp x cp ranks
    config["train_micro_batch_size_per_gpu"] = layout.micro_batch_size
    config["gradient_accumulation_steps"] = layout.grad_accum
    if "gradient_clipping" not in config:
        config["gradient_clipping"] = DEFAULT_CLIP_GRAD if clip_grad is None else clip_grad
    if sequence_parallel:
        config["pipeline"] = {**config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    return config


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's layout flags, read as `LayoutFlags` (docs/flags.md)."""
    p = parser.add_argument_group("layout and batch")
    p.add_argument("--tensor-parallel-size", "--tp", "--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", "--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--context-parallel-size",
        "--cp",
        type=int,
        default=1,
        help="split every sequence into this many consecutive slices, one per rank (state passing)",
    )
    p.add_argument(
        "--expert-model-parallel-size",
        "--ep",
        type=int,
        default=1,
        help="split every mixture-of-experts layer's experts over this many data x context-parallel ranks",
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=1,
        choices=[1],
        help="experts are not split across tensor-parallel ranks: only 1 (Megatron's name)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="train_micro_batch_size_per_gpu (a JSON giving another value is refused)",
    )
    p.add_argument(
        "--global-batch-size", type=int, default=None, help="train_batch_size (a JSON giving another value is refused)"
    )
    p.add_argument(
        "--sequence-parallel", action="store_true", help="split activations along the sequence over TP ranks"
    )
    p.add_argument(
        "--partition-method",
        default=DEFAULT_PARTITION,
        help="pipeline stages: cost (balanced forward FLOPs at --seq-length) | DeepSpeed's uniform | "
        "parameters | type:<regex>; a hybrid_layer_pattern's | marks set them whatever the method",
    )
    p.add_argument(
        "--torch-compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile the model with torch.compile through DeepSpeed's engine.compile: inductor (the default), "
        "or another torch.compile backend such as aot_eager",
    )
    p.add_argument(
        "--checkpoint-activations-interval",
        type=int,
        default=0,
        help="recompute runs of this many consecutive layers in the backward (0: off)",
    )
