"""Train a Mamba LM with DeepSpeed: data x context x tensor x pipeline parallelism, ZeRO, one command.

    deepspeed --num_gpus 8 launch/train.py --deepspeed_config launch/configs/mamba2-130m.json \\
        --model-config launch/models/mamba2-130m.json --pipeline-parallel-size 2 --train-iters 1000

The flags and the DeepSpeed JSON become one run plan (`prepare`: every check that needs no process
group; a failure prints one line and exits with status 2), then `start_run` builds the trainer and
sets its weights, and `TrainingLoop` runs the steps. Flags: docs/flags.md; engines, data, metrics,
checkpoints and resume: docs/training.md.
"""

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from typing import NamedTuple, Optional, Union

import hjson
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.checkpoint import CheckpointError
from megamamba.config import ConfigError, MambaConfig
from megamamba.data.training_data import TrainingData, training_data
from megamamba.observe import console_log
from megamamba.observe.monitor_config import MONITOR_BLOCKS, Monitors, monitors_from_config
from megamamba.observe.run_console import count_parameters, startup_summary
from megamamba.parallel.groups import init_distributed, shutdown_distributed, topology
from megamamba.parallel.placement import PlacementError, check_placement
from megamamba.pipelines.config.ds_translate import OptimizerFlags, optimizer_settings
from megamamba.pipelines.config.layout import (
    Layout,
    LayoutError,
    LayoutFlags,
    check_run,
    engine_config,
    resolve_layout,
)
from megamamba.pipelines.job import checkpointing, init_from
from megamamba.pipelines.job.resume import ResumeFlags, fresh, resume_line, resumed_run, run_stream
from megamamba.pipelines.loop.agreement import agree
from megamamba.pipelines.loop.engine import OptimizerSettings, build_trainer
from megamamba.pipelines.loop.faults import (
    NonFiniteSteps,
    check_loss_spike_factor,
    check_max_skipped_steps,
    check_step_timeout,
)
from megamamba.pipelines.loop.training import LoopSettings, StartedRun, TrainingLoop
from megamamba.pipelines.memory.fit import MemoryPlanError, check_at_start
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.planner.for_run import choice_lines, choose, default_profile
from megamamba.pipelines.planner.profile import ProfileError, load_profile
from megamamba.pipelines.planner.search import PlanError
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION, check_partition_method
from megamamba.schedule.lr_schedule import DECAY_STYLES, DeepSpeedSchedule, LRSchedule

log = logging.getLogger("megamamba.launch.train")  # shown as `train.py: ...` (megamamba.observe.console_log)

# DeepSpeed's pipeline sends activations with an in-place broadcast where p2p send/recv is not
# available (gloo); autograd then warns once per rank about a node it never differentiates.
warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")


def _parser() -> argparse.ArgumentParser:
    """Our flags, DeepSpeed's (--deepspeed, --deepspeed_config) and Megatron's names for the same settings
    (--tensor-model-parallel-size, --micro-batch-size, --data-path, ...); no abbreviations."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
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
    p.add_argument("--train-iters", type=int, default=None, help="optimizer steps (or --train-samples)")
    p.add_argument(
        "--train-samples", type=int, default=None, help="samples to train on: train iters = samples / global batch size"
    )
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--data",
        "--data-path",
        nargs="*",
        default=[],
        help="preprocessed dataset prefix, or pairs 'weight prefix' to blend (default: the built-in "
        "corpus tokenized in memory)",
    )
    p.add_argument("--valid-data", nargs="*", default=[], help="validation dataset prefix or blend (with --data)")
    p.add_argument(
        "--split",
        default=None,
        help="Megatron's: train,validation,test proportions carved from every --data dataset by document "
        "ranges, e.g. 969,30,1 (instead of --valid-data; the test part is unused)",
    )
    p.add_argument(
        "--tokenizer", default="bytes", help="bytes | a SentencePiece .model | a tokenizer.json | a folder holding one"
    )
    p.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="train on --data made with another tokenizer than --tokenizer (refused otherwise)",
    )
    p.add_argument(
        "--no-reset-at-documents", action="store_true", help="let the state run across packed documents (no seq_idx)"
    )
    # None: not given; pipelines.config.ds_translate resolves the JSON's value, the flag's, or the default (in brackets)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate [3e-4]")
    p.add_argument("--min-lr", type=float, default=None, help="[3e-5]")
    p.add_argument("--lr-warmup-iters", type=int, default=None, help="[0]")
    p.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warm-up as a fraction of the decay iters (instead of --lr-warmup-iters)",
    )
    p.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="steps until the LR reaches --min-lr (default: the train iters)",
    )
    p.add_argument("--lr-decay-style", default=None, choices=DECAY_STYLES, help="[cosine]")
    p.add_argument("--weight-decay", type=float, default=None, help="[0.1]")
    p.add_argument("--adam-beta1", type=float, default=None, help="[0.9]")
    p.add_argument("--adam-beta2", type=float, default=None, help="[0.95]")
    p.add_argument("--adam-eps", type=float, default=None, help="[1e-8]")
    p.add_argument("--clip-grad", type=float, default=None, help="max global gradient norm (default 1.0)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--eval-interval", type=int, default=0, help="validation every this many steps (0: never)")
    p.add_argument("--eval-iters", type=int, default=4, help="validation global batches per evaluation")
    p.add_argument("--log-dir", default=None, help="TensorBoard directory")
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON object per logged step")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak TFLOP/s, for MFU")
    p.add_argument("--save", default=None, help="checkpoint directory (created and checked writable at start-up)")
    p.add_argument(
        "--load",
        default=None,
        help="resume from: auto (the newest complete checkpoint under --save; none yet: start afresh), "
        "a save directory (its latest) or a checkpoint directory",
    )
    p.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --load: the weights and the step count only; fresh optimizer state and LR schedule",
    )
    p.add_argument("--no-load-rng", action="store_true", help="with --load: do not restore the RNG states")
    p.add_argument(
        "--override-data-check",
        action="store_true",
        help="resume even though the data, tokenizer, --seq-length, --seed or document resets differ from "
        "the checkpoint's (refused otherwise): the sample stream continues at its count with the new "
        "settings",
    )
    p.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="resume even though the LR plan differs from the checkpoint's (refused otherwise): follow "
        "the flags' plan from the checkpoint's step",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of DIR (a checkpoint or save directory, a model folder, a mamba_ssm "
        "or transformers Mamba/Mamba2 folder; checksums verified when it has a manifest) at step 0 "
        "with a fresh optimizer, LR schedule and RNG; its config must equal --model-config. A "
        "checkpoint that --load finds wins: --init-from DIR --save D --load auto resumes on requeue",
    )
    p.add_argument(
        "--finetune",
        action="store_true",
        help="Megatron's: only the weights of --load, at step 0 with a fresh optimizer, LR schedule and "
        "RNG (the same as --init-from, which a requeue-safe job uses with --load auto)",
    )
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every this many steps (0: at the end)")
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints to keep (default: all)")
    p.add_argument(
        "--max-skipped-steps",
        type=int,
        default=5,
        help="abort after this many steps in a row skipped for non-finite loss or gradients (or spikes)",
    )
    p.add_argument(
        "--loss-spike-factor",
        type=float,
        default=None,
        help="a loss above this many times the running median of recent losses counts as a skipped "
        "step: no checkpoint, counted toward --max-skipped-steps (its update is applied)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=600,
        help="exit when no step finishes for this many seconds after the first (0: off)",
    )
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="start even when the start-up memory plan says a rank does not fit its GPU",
    )
    p.add_argument(
        "--auto-parallel",
        action="store_true",
        help="choose tp, pp, cp, the ZeRO stage, the micro batch and recomputation with the planner "
        "(launch/plan.py) for this world size and device memory; what you set stays fixed",
    )
    p.add_argument(
        "--plan-profile",
        default=None,
        metavar="PROFILE",
        help="hardware profile for --auto-parallel (default: launch/profiles/ by GPU name; "
        "launch/profiles/cpu.json on the CPU)",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return _parser().parse_args(argv)


_UNSET = object()


def given_flags(argv=None) -> set:
    """The settings (their dests) that `argv` gives explicitly, defaults left out."""
    marked = argparse.Namespace(**{dest: _UNSET for dest in vars(parse_args(argv))})
    return {dest for dest, value in vars(_parser().parse_args(argv, namespace=marked)).items() if value is not _UNSET}


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


def _read_deepspeed_config(path: str) -> dict:
    """The DeepSpeed config as DeepSpeed reads it: hjson (JSON plus comments, unquoted keys, ...)."""
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
    )


def _model_config(path: str, pattern: Optional[str]) -> MambaConfig:
    """The --model-config file, with --hybrid-layer-pattern as its hybrid_layer_pattern (a file giving
    another pattern is refused, as a flag and the JSON disagreeing are)."""
    fields = _read_json(path, "--model-config")
    where = f"--model-config {path!r}"
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


def resume_flags(args: argparse.Namespace) -> ResumeFlags:
    return ResumeFlags(
        args.train_samples,
        args.override_data_check,
        args.override_opt_param_scheduler,
        args.no_load_optim,
        args.no_load_rng,
        optimizer_flags(args),
    )


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


def prepare(args: argparse.Namespace, world_size: int, flags: Optional[LayoutFlags] = None) -> RunPlan:
    """Every check that needs no process group, for the layout `flags` (default: the flags'); raises LayoutError
    with one message."""
    flags = flags or layout_flags(args)
    ds_config = flags.with_batch(_read_deepspeed_config(args.deepspeed_config))
    model = _model_config(args.model_config, args.hybrid_layer_pattern)
    layout = resolve_layout(world_size, flags.tp, flags.pp, ds_config, flags.cp)
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
    )


PLANNED = {
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "context_parallel_size": "cp",
    "checkpoint_activations_interval": "recompute",
    "micro_batch_size": "micro_batch_size",
}


def auto_parallel(args: argparse.Namespace, argv, world_size: int) -> tuple[LayoutFlags, list]:
    """--auto-parallel: the flags' layout with the planner's choice for this job, and the lines saying what it
    chose; what the user set stays."""
    flags = layout_flags(args)
    ds_config = flags.with_batch(_read_deepspeed_config(args.deepspeed_config))
    model = _model_config(args.model_config, args.hybrid_layer_pattern)
    given = {PLANNED[dest]: getattr(args, dest) for dest in given_flags(argv) & set(PLANNED)}
    if "recompute" in given:
        given["recompute"] = given["recompute"] > 0
    accelerator = get_accelerator()
    local_ranks = int(os.environ.get("LOCAL_SIZE", world_size))
    if accelerator.device_name() == "cpu":  # the host's memory, shared by the node's ranks
        device, memory = None, accelerator.total_memory() // local_ranks
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device, memory = torch.cuda.get_device_name(local_rank), accelerator.total_memory(local_rank)
    profiles = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
    profile = load_profile(args.plan_profile or default_profile(profiles, device))
    choice = choose(model, ds_config, given, world_size, local_ranks, memory, args.seq_length, profile)
    best = choice.best
    chosen = dataclasses.replace(
        flags,
        tp=best.tp,
        pp=best.pp,
        cp=best.cp,
        sequence_parallel=flags.sequence_parallel or best.sequence_parallel,
        micro_batch_size=best.micro_batch_size,
        zero_stage=best.zero_stage,
        checkpoint_interval=1 if best.recompute and "recompute" not in given else flags.checkpoint_interval,
    )
    return chosen, choice_lines(choice)


def fail(error, status: int = 2):
    """One line on stderr, this rank's process group torn down, then exit with `status`.

    Without the teardown a rank can abort at exit (SIGABRT, "terminate called without an active
    exception") instead of exiting with the status.
    """
    print(f"train.py: error: {error}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def main(argv=None) -> dict:
    """Train; returns this rank's summary: logged records, optimizer-state bytes, stage parameter count."""
    job_start = time.perf_counter()
    console_log.configure()
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        flags, chosen = auto_parallel(args, argv, world_size) if args.auto_parallel else (layout_flags(args), [])
        plan = prepare(args, world_size, flags)
    except (LayoutError, PlanError, ProfileError) as e:
        fail(e)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in chosen:
            log.info(line)

    init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()
    layout = plan.layout
    try:
        check_placement(topology(layout.tp, layout.pp, layout.dp, layout.cp))
        memory_lines = check_at_start(
            plan_memory(
                RunShape.of_run(
                    plan.model,
                    layout,
                    plan.engine_config,
                    args.seq_length // layout.cp,
                    flags.partition_method,
                    flags.checkpoint_interval,
                    flags.sequence_parallel,
                )
            ),
            args.no_memory_check,
        )
        lock = checkpointing.lock_save_dir(args.save) if args.save else None
    except (PlacementError, MemoryPlanError, CheckpointError) as e:
        fail(e)
    if rank == 0:
        console_log.show("\n".join(memory_lines))
        if plan.deepspeed_line:
            print(plan.deepspeed_line, flush=True)
        for note in plan.data.warnings:
            log.warning(note)
    try:
        return run_training(args, plan, job_start)
    finally:
        if lock is not None:
            lock.release()


def start_run(args: argparse.Namespace, plan: RunPlan) -> StartedRun:
    """The trainer built and its weights set: resumed from --load, initialised from --init-from, or fresh."""
    load, initial = init_from.sources(args.init_from, args.finetune, args.load)
    try:
        resume = checkpointing.open_for_run(load, args.save, plan.model)
        stream = run_stream(plan.data, args.tokenizer) if args.save or resume else None
        global_batch = plan.layout.global_batch_size
        run_start = (
            fresh(plan.train_iters, plan.schedule, global_batch)
            if not resume
            else resumed_run(
                resume, resume_flags(args), stream, global_batch, plan.train_iters, plan.schedule, plan.ds_config
            )
        )
        settings = dataclasses.replace(plan.optimizer, schedule=run_start.schedule)
        source = init_from.open_source(*initial, plan.model) if initial and not resume else None
        trainer = build_trainer(
            plan.layout,
            plan.model,
            plan.engine_config,
            settings,
            args.seed,
            plan.flags.partition_method,
            plan.flags.checkpoint_interval,
            plan.flags.sequence_parallel,
            seq_length=args.seq_length,
            compile_backend=args.torch_compile,
        )
        if args.save or load:
            checkpointing.check_trainer(trainer)
        if resume:
            checkpointing.load(trainer, resume, plan.model, not args.no_load_optim, not args.no_load_rng)
        if source:
            init_from.load_weights(trainer, source)
    except CheckpointError as e:
        fail(e)
    return StartedRun(trainer, resume, run_start, stream, initial, source)


def announce(args: argparse.Namespace, plan: RunPlan, run: StartedRun, loop: TrainingLoop) -> None:
    """The start-up summary, and what the weights came from (collective: every rank counts its stage)."""
    low, high = agree([-loop.stage_params, loop.stage_params], op="max")
    if loop.rank != 0:
        return
    console_log.show(
        "\n".join(
            startup_summary(
                model=plan.model,
                layout=plan.layout,
                seq_length=args.seq_length,
                train_iters=loop.train_iters,
                schedule=run.run_start.lr_plan,
                engine_config=plan.engine_config,
                data=plan.data,
                total_params=count_parameters(plan.model),
                stage_params=(int(-low), int(high)),
                save=args.save,
                load=args.load,
                save_interval=args.save_interval,
                keep_last=args.keep_last,
            )
        )
    )
    if run.resume:
        if run.run_start.warning:
            log.warning(run.run_start.warning)
        log.info(resume_line(run.resume.path, run.run_start))
        if run.initial:
            log.info(f"{run.initial[0]} not used: --load found {run.resume.path} to resume")
    if run.source:
        log.info(init_from.startup_line(run.source))


def loop_settings(args: argparse.Namespace, plan: RunPlan) -> LoopSettings:
    return LoopSettings(
        args.seq_length,
        args.log_interval,
        args.eval_interval,
        args.eval_iters,
        args.save,
        args.save_interval,
        args.keep_last,
        args.peak_tflops,
        args.metrics_jsonl,
        args.max_skipped_steps,
        args.loss_spike_factor,
        args.step_timeout,
        {**vars(args), "layout_flags": dataclasses.asdict(plan.flags)},
    )


def run_training(args: argparse.Namespace, plan: RunPlan, job_start: float) -> dict:
    """The trainer built, the start-up announced, every step run; this rank's summary."""
    run = start_run(args, plan)
    loop = TrainingLoop(loop_settings(args, plan), plan.model, plan.layout, plan.data, plan.monitors, run, job_start)
    announce(args, plan, run, loop)
    try:
        summary = loop.run()
    except NonFiniteSteps as e:
        fail(e, status=1)
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    main()
