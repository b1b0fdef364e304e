"""The run plan: launch/train.py's flags and the DeepSpeed JSON read and checked before any process group.

`prepare` makes every check that needs no process group; a failure is one LayoutError.
"""

import argparse
import json
from typing import NamedTuple, Optional, Union

import hjson

from megamamba.checkpoint import CheckpointError
from megamamba.config import ConfigError, MambaConfig
from megamamba.data.training_data import TrainingData, training_data
from megamamba.observe import console_log
from megamamba.observe.monitor_config import MONITOR_BLOCKS, Monitors, monitors_from_config
from megamamba.pipelines.config.ds_keys import check_deepspeed_keys
from megamamba.pipelines.config.ds_translate import OptimizerFlags, optimizer_settings
from megamamba.pipelines.config.layout import (
    Layout,
    LayoutError,
    LayoutFlags,
    check_run,
    engine_config,
    resolve_layout,
)
from megamamba.pipelines.config.moe_flags import flags_text, moe_cfg_flags, with_moe_flags
from megamamba.pipelines.job import checkpointing, init_from
from megamamba.pipelines.loop.engine import OptimizerSettings
from megamamba.pipelines.loop.faults import (
    check_loss_spike_factor,
    check_max_skipped_steps,
    check_step_timeout,
)
from megamamba.pipelines.loop.task_evaluation import TaskSettings, task_settings
from megamamba.pipelines.stages.partition import check_partition_method
from megamamba.schedule.lr_schedule import DeepSpeedSchedule, LRSchedule


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LayoutError(f"{what} {path!r}: {e}") from None


# Blocks of the DeepSpeed config that are read as objects (here, in pipelines.config.layout or by DeepSpeed).
OBJECT_BLOCKS = (
    "zero_optimization",
    "bf16",
    "fp16",
    "torch_autocast",
    "pipeline",
    "tensorboard",
    "timers",
    "optimizer",
    "scheduler",
    "activation_checkpointing",
)


def read_deepspeed_config(path: str) -> dict:
    """The DeepSpeed config as DeepSpeed reads it: hjson (JSON plus comments, unquoted keys, ...), every key one
    DeepSpeed reads and every value of a type it takes (`ds_keys`)."""
    try:
        with open(path) as f:
            config = hjson.load(f, object_pairs_hook=dict)
    except (OSError, hjson.HjsonDecodeError) as e:
        raise LayoutError(f"--deepspeed_config {path!r}: {e}") from None
    if not isinstance(config, dict):
        raise LayoutError(f"--deepspeed_config {path!r}: holds {type(config).__name__}, not an object of settings")
    for key in OBJECT_BLOCKS:
        if key in config and not isinstance(config[key], dict):
            raise LayoutError(
                f'--deepspeed_config {path!r}: "{key}" is {json.dumps(config[key])}; it must be an '
                f'object (e.g. {{"stage": 1}} for zero_optimization), or leave the key out'
            )
    check_deepspeed_keys(config, f"--deepspeed_config {path!r}")
    return config


def layout_flags(args: argparse.Namespace) -> LayoutFlags:
    return LayoutFlags(
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.context_parallel_size,
        args.sequence_parallel,
        args.micro_batch_size,
        args.global_batch_size,
        None,
        args.checkpoint_activations_interval,
        args.partition_method,
        args.expert_model_parallel_size,
    )


def model_config(path: str, pattern: Optional[str], moe_flags: Optional[dict] = None) -> MambaConfig:
    """The --model-config file, with --hybrid-layer-pattern as its hybrid_layer_pattern (a file giving
    another pattern is refused, as a flag and the JSON disagreeing are) and Megatron's MoE flags
    (`moe_flags`: `pipelines.config.moe_flags.moe_cfg_flags`) in its moe_cfg."""
    fields = _read_json(path, "--model-config")
    where = f"--model-config {path!r}"
    if moe_flags:
        fields = with_moe_flags(fields, moe_flags, where)
        where = f"{flags_text(moe_flags)} with {where}"
    if pattern is not None:
        if fields.get("hybrid_layer_pattern", pattern) not in ("", pattern):
            raise LayoutError(
                f"--hybrid-layer-pattern {pattern!r} disagrees with {where}'s hybrid_layer_pattern="
                f"{fields['hybrid_layer_pattern']!r}; keep one"
            )
        fields = {**fields, "hybrid_layer_pattern": pattern}
        where = f"--hybrid-layer-pattern {pattern!r} with {where}"
    try:
        return MambaConfig.from_dict(fields)
    except ConfigError as e:
        raise LayoutError(f"{where}: {e}") from None


def optimizer_flags(args: argparse.Namespace) -> OptimizerFlags:
    return OptimizerFlags(**{name: getattr(args, name) for name in OptimizerFlags._fields})


def _train_iters(args, global_batch_size: int) -> int:
    """--train-iters, or --train-samples / global batch size (Megatron's sample-based length); exactly one."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise LayoutError("give exactly one of --train-iters and --train-samples")
    if args.train_iters is not None:
        return args.train_iters
    if args.train_samples < global_batch_size:
        raise LayoutError(f"--train-samples {args.train_samples} is less than one global batch ({global_batch_size})")
    return args.train_samples // global_batch_size


class RunPlan(NamedTuple):
    train_iters: int
    layout: Layout
    model: MambaConfig
    engine_config: dict
    schedule: Union[LRSchedule, DeepSpeedSchedule]
    monitors: Monitors
    data: TrainingData
    optimizer: OptimizerSettings
    deepspeed_line: Optional[str]  # what the JSON's optimizer/scheduler/bf16 blocks became; None without them
    ds_config: dict  # the DeepSpeed config with the batch flags applied (a resume re-plans the LR from it)
    flags: LayoutFlags
    eval_tasks: Optional[TaskSettings]  # --eval-tasks, checked; None without it


def prepare(args: argparse.Namespace, world_size: int, flags: Optional[LayoutFlags] = None) -> RunPlan:
    """Every check that needs no process group, for the layout `flags` (default: the flags'); raises LayoutError
    with one message."""
    flags = flags or layout_flags(args)
    ds_config = flags.with_batch(read_deepspeed_config(args.deepspeed_config))
    model = model_config(args.model_config, args.hybrid_layer_pattern, moe_cfg_flags(args))
    layout = resolve_layout(world_size, flags.tp, flags.pp, ds_config, flags.cp, flags.ep)
    check_run(layout, ds_config, model, args.seq_length, flags.sequence_parallel, args.clip_grad)
    if flags.checkpoint_interval < 0:
        raise LayoutError(f"--checkpoint-activations-interval {flags.checkpoint_interval}: must be >= 0")
    try:
        check_partition_method(flags.partition_method)
        train_iters = _train_iters(args, layout.global_batch_size)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    settings = optimizer_settings(ds_config, optimizer_flags(args), train_iters)
    try:
        data = training_data(
            model,
            args.tokenizer,
            args.data,
            args.valid_data,
            args.seq_length,
            layout.global_batch_size,
            args.seed,
            not args.no_reset_at_documents,
            needs_validation=args.eval_interval > 0,
            allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
            split=args.split,
        )
    except (OSError, ValueError) as e:
        raise LayoutError(str(e)) from None
    try:
        init_from.check_flags(args.init_from, args.finetune, args.load)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    try:
        checkpointing.check_flags(args.save, args.load, args.save_interval, args.keep_last)
    except CheckpointError as e:
        raise LayoutError(str(e)) from None
    try:
        check_max_skipped_steps(args.max_skipped_steps)
        check_loss_spike_factor(args.loss_spike_factor)
        check_step_timeout(args.step_timeout)
        monitors = monitors_from_config(ds_config, args.log_dir)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    eval_tasks = task_settings(args)
    without_monitors = {k: v for k, v in ds_config.items() if k not in MONITOR_BLOCKS}  # our logger writes them
    return RunPlan(
        train_iters,
        layout,
        model,
        engine_config(without_monitors, layout, args.clip_grad, flags.sequence_parallel),
        settings.optimizer.schedule,
        monitors,
        data,
        settings.optimizer,
        None if settings.line is None else f"{console_log.PROGRAM}: {settings.line}",
        ds_config,
        flags,
        eval_tasks,
    )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's flags of the run itself: DeepSpeed's config, the model, its length and seed (docs/flags.md)."""
    p = parser.add_argument_group("run")
    p.add_argument(
        "--deepspeed", action="store_true", help="accepted as DeepSpeed scripts take it; DeepSpeed is always on"
    )
    p.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        required=True,
        help="DeepSpeed config (JSON, or hjson as DeepSpeed reads it)",
    )
    p.add_argument("--model-config", required=True, help="mamba_ssm-style config.json of the model")
    p.add_argument(
        "--hybrid-layer-pattern",
        "--hybrid-override-pattern",
        default=None,
        metavar="PATTERN",
        help="Megatron's layer pattern, one symbol a layer: M Mamba, * attention, - MLP, | a pipeline-stage "
        "boundary; sets the model config's hybrid_layer_pattern (its layer count must equal n_layer)",
    )
    p.add_argument("--train-iters", type=int, default=None, help="optimizer steps (or --train-samples)")
    p.add_argument(
        "--train-samples", type=int, default=None, help="samples to train on: train iters = samples / global batch size"
    )
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
