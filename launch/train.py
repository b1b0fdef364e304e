"""Train a Mamba LM with DeepSpeed: data x tensor x pipeline parallelism, ZeRO, one command.

    deepspeed --num_gpus 8 launch/train.py --deepspeed_config launch/configs/mamba2-130m.json \\
        --model-config launch/models/mamba2-130m.json --pipeline-parallel-size 2 --train-iters 1000

Data-parallel size = world size / (context x tensor x pipeline parallel size); the ranks of a
context-parallel group (--context-parallel-size C) each hold 1/C of every sequence. Every
consistency check runs before any process group exists (`megamamba.pipelines.config.layout`); a failure
prints one line and exits with status 2. The optimizer and learning-rate schedule come from the
flags below or from the JSON's "optimizer" (Adam/AdamW) and "scheduler" (WarmupLR, WarmupDecayLR,
WarmupCosineLR) blocks, and "bf16" enabled means torch_autocast bf16 with float32 parameters
(`megamamba.pipelines.config.ds_translate`; a JSON value and a flag that disagree are refused; rank 0
prints one line saying what was translated). Megatron's names are accepted for the same
settings (--tensor-model-parallel-size, --pipeline-model-parallel-size, --micro-batch-size,
--global-batch-size, --train-samples, --lr-decay-iters, --lr-warmup-fraction, --data-path), the
DeepSpeed config is read as hjson as DeepSpeed reads it, and flags are never abbreviated. Metrics
(step, loss, lr, grad_norm, tokens_per_s, tflops_per_device, mem_peak_gb, val_loss, mfu) go to
the console of global rank 0, to --metrics-jsonl, to TensorBoard (--log-dir, else the JSON's
"tensorboard" block) and to CSV files and wandb (the JSON's "csv_monitor" and "wandb" blocks;
`megamamba.observe.monitor_config`). Data (`megamamba.data.training_data`): --tokenizer,
--data / --valid-data blends of preprocessed datasets (default: the built-in corpus tokenized in
memory), packed with document ids (seq_idx) unless --no-reset-at-documents; data made with another
tokenizer is refused unless --allow-tokenizer-mismatch. With --save, global rank 0 holds the save
directory's lock for the job's life (a second job is refused at start-up), no checkpoint is written
and none pruned while steps are being skipped (non-finite, or a --loss-spike-factor spike), and
--keep-last never removes the newest checkpoint from before the first skipped step. A resume
(--load) continues the sample stream at the checkpoint's consumed samples at any global batch size
and refuses a changed data stream or LR plan unless --override-data-check /
--override-opt_param-scheduler (`megamamba.pipelines.job.resume`); --no-load-optim and --no-load-rng
as in Megatron.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from typing import NamedTuple, Optional, Union

import hjson
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.checkpoint import CheckpointError, tag_for
from megamamba.config import ConfigError, MambaConfig
from megamamba.data.training_data import TrainingData, training_data
from megamamba.model.flops import training_flops_per_token
from megamamba.observe import console_log
from megamamba.observe.metrics import MetricsLogger
from megamamba.observe.monitor_config import MONITOR_BLOCKS, Monitors, monitors_from_config
from megamamba.observe.run_console import StepClock, count_parameters, optimizer_state_lines, startup_summary
from megamamba.parallel.groups import init_distributed, shutdown_distributed, topology
from megamamba.parallel.placement import PlacementError, check_placement
from megamamba.pipelines.config.ds_translate import optimizer_settings
from megamamba.pipelines.config.layout import Layout, LayoutError, check_run, engine_config, resolve_layout
from megamamba.pipelines.deepspeed_internals import full_numel
from megamamba.pipelines.job import checkpointing, init_from
from megamamba.pipelines.job.resume import fresh, records, resume_line, resumed_run, run_stream
from megamamba.pipelines.loop.agreement import agree
from megamamba.pipelines.loop.engine import OptimizerSettings, build_trainer
from megamamba.pipelines.loop.faults import (
    NonFiniteGuard,
    NonFiniteSteps,
    StopRequest,
    Watchdog,
    agree_step,
    check_loss_spike_factor,
    check_max_skipped_steps,
    check_step_timeout,
)
from megamamba.pipelines.memory.fit import MemoryPlanError, check_at_start
from megamamba.pipelines.memory.optimizer_state import optimizer_state_bytes
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.stages.pipeline_module import check_partition_method
from megamamba.schedule.lr_schedule import DECAY_STYLES, DeepSpeedSchedule, LRSchedule

# DeepSpeed's pipeline sends activations with an in-place broadcast where p2p send/recv is not
# available (gloo); autograd then warns once per rank about a node it never differentiates.
warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")


def parse_args(argv=None) -> argparse.Namespace:
    """Our flags, DeepSpeed's (--deepspeed, --deepspeed_config) and Megatron's names for the same settings
    (--tensor-model-parallel-size, --micro-batch-size, --data-path, ...); no abbreviations."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted as DeepSpeed scripts take it; DeepSpeed is always on")
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True,
                   help="DeepSpeed config (JSON, or hjson as DeepSpeed reads it)")
    p.add_argument("--model-config", required=True, help="mamba_ssm-style config.json of the model")
    p.add_argument("--tensor-parallel-size", "--tp", "--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", "--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", "--cp", type=int, default=1,
                   help="split every sequence into this many consecutive slices, one per rank (state passing)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="train_micro_batch_size_per_gpu (a JSON giving another value is refused)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="train_batch_size (a JSON giving another value is refused)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="split activations along the sequence over TP ranks")
    p.add_argument("--partition-method", default="type:Block", help="uniform | parameters | type:<regex>")
    p.add_argument("--checkpoint-activations-interval", type=int, default=0,
                   help="recompute runs of this many consecutive layers in the backward (0: off)")
    p.add_argument("--train-iters", type=int, default=None, help="optimizer steps (or --train-samples)")
    p.add_argument("--train-samples", type=int, default=None,
                   help="samples to train on: train iters = samples / global batch size")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", "--data-path", nargs="*", default=[],
                   help="preprocessed dataset prefix, or pairs 'weight prefix' to blend (default: the built-in "
                        "corpus tokenized in memory)")
    p.add_argument("--valid-data", nargs="*", default=[], help="validation dataset prefix or blend (with --data)")
    p.add_argument("--split", default=None,
                   help="Megatron's: train,validation,test proportions carved from every --data dataset by document "
                        "ranges, e.g. 969,30,1 (instead of --valid-data; the test part is unused)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes | a SentencePiece .model | a tokenizer.json | a folder holding one")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="train on --data made with another tokenizer than --tokenizer (refused otherwise)")
    p.add_argument("--no-reset-at-documents", action="store_true",
                   help="let the state run across packed documents (no seq_idx)")
    # None: not given; pipelines.config.ds_translate resolves the JSON's value, the flag's, or the default (in brackets)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate [3e-4]")
    p.add_argument("--min-lr", type=float, default=None, help="[3e-5]")
    p.add_argument("--lr-warmup-iters", type=int, default=None, help="[0]")
    p.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iters (instead of --lr-warmup-iters)")
    p.add_argument("--lr-decay-iters", type=int, default=None, help="steps until the LR reaches --min-lr "
                   "(default: the train iters)")
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
    p.add_argument("--load", default=None,
                   help="resume from: auto (the newest complete checkpoint under --save; none yet: start afresh), "
                        "a save directory (its latest) or a checkpoint directory")
    p.add_argument("--no-load-optim", action="store_true",
                   help="with --load: the weights and the step count only; fresh optimizer state and LR schedule")
    p.add_argument("--no-load-rng", action="store_true", help="with --load: do not restore the RNG states")
    p.add_argument("--override-data-check", action="store_true",
                   help="resume even though the data, tokenizer, --seq-length, --seed or document resets differ from "
                        "the checkpoint's (refused otherwise): the sample stream continues at its count with the new "
                        "settings")
    p.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   help="resume even though the LR plan differs from the checkpoint's (refused otherwise): follow "
                        "the flags' plan from the checkpoint's step")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from the weights of DIR (a checkpoint or save directory, a model folder, a mamba_ssm "
                        "or transformers Mamba/Mamba2 folder; checksums verified when it has a manifest) at step 0 "
                        "with a fresh optimizer, LR schedule and RNG; its config must equal --model-config. A "
                        "checkpoint that --load finds wins: --init-from DIR --save D --load auto resumes on requeue")
    p.add_argument("--finetune", action="store_true",
                   help="Megatron's: only the weights of --load, at step 0 with a fresh optimizer, LR schedule and "
                        "RNG (the same as --init-from, which a requeue-safe job uses with --load auto)")
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every this many steps (0: at the end)")
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints to keep (default: all)")
    p.add_argument("--max-skipped-steps", type=int, default=5,
                   help="abort after this many steps in a row skipped for non-finite loss or gradients (or spikes)")
    p.add_argument("--loss-spike-factor", type=float, default=None,
                   help="a loss above this many times the running median of recent losses counts as a skipped "
                        "step: no checkpoint, counted toward --max-skipped-steps (its update is applied)")
    p.add_argument("--step-timeout", type=float, default=600,
                   help="exit when no step finishes for this many seconds after the first (0: off)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even when the start-up memory plan says a rank does not fit its GPU")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LayoutError(f"{what} {path!r}: {e}") from None


# Blocks of the DeepSpeed config that are read as objects (here, in pipelines.config.layout or by DeepSpeed).
OBJECT_BLOCKS = ("zero_optimization", "bf16", "fp16", "torch_autocast", "pipeline", "tensorboard", "timers",
                 "optimizer", "scheduler", "activation_checkpointing")


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
            raise LayoutError(f"--deepspeed_config {path!r}: \"{key}\" is {json.dumps(config[key])}; it must be an "
                              f"object (e.g. {{\"stage\": 1}} for zero_optimization), or leave the key out")
    return config


def _with_batch_flags(ds_config: dict, args) -> dict:
    """The JSON's batch keys with --micro-batch-size / --global-batch-size applied; a disagreement is refused."""
    config = dict(ds_config)
    for flag, key, value in (("--micro-batch-size", "train_micro_batch_size_per_gpu", args.micro_batch_size),
                             ("--global-batch-size", "train_batch_size", args.global_batch_size)):
        if value is None:
            continue
        if config.get(key) is not None and config[key] != value:
            raise LayoutError(f"{flag} {value} disagrees with the DeepSpeed config's {key}={config[key]}; keep one")
        config[key] = value
    return config


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


def prepare(args: argparse.Namespace, world_size: int) -> RunPlan:
    """Every check that needs no process group; raises LayoutError with one message."""
    ds_config = _with_batch_flags(_read_deepspeed_config(args.deepspeed_config), args)
    try:
        model = MambaConfig.from_dict(_read_json(args.model_config, "--model-config"))
    except ConfigError as e:
        raise LayoutError(f"--model-config {args.model_config!r}: {e}") from None
    layout = resolve_layout(world_size, args.tensor_parallel_size, args.pipeline_parallel_size, ds_config,
                            args.context_parallel_size)
    check_run(layout, ds_config, model, args.seq_length, args.sequence_parallel, args.clip_grad)
    if args.checkpoint_activations_interval < 0:
        raise LayoutError(f"--checkpoint-activations-interval {args.checkpoint_activations_interval}: must be >= 0")
    try:
        check_partition_method(args.partition_method)
        train_iters = _train_iters(args, layout.global_batch_size)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    settings = optimizer_settings(ds_config, args, train_iters)
    try:
        data = training_data(model, args.tokenizer, args.data, args.valid_data, args.seq_length,
                             layout.global_batch_size, args.seed, not args.no_reset_at_documents,
                             needs_validation=args.eval_interval > 0,
                             allow_tokenizer_mismatch=args.allow_tokenizer_mismatch, split=args.split)
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
    return RunPlan(train_iters, layout, model,
                   engine_config(without_monitors, layout, args.clip_grad, args.sequence_parallel),
                   settings.optimizer.schedule, monitors, data, settings.optimizer, settings.line, ds_config)


def peak_memory_gb() -> float:
    """Largest peak of device memory (host RSS on CPU) over all ranks, GiB (collective)."""
    return agree([get_accelerator().max_memory_allocated() / 2**30], op="max")[0]


def per_rank_values(values: list) -> list:
    """Every rank's `values` (small integers), in rank order, in one collective; a tuple per rank."""
    world, rank, width = dist.get_world_size(), dist.get_rank(), len(values)
    slots = [0] * (world * width)
    slots[rank * width:(rank + 1) * width] = values
    reduced = agree(slots)
    return [tuple(int(v) for v in reduced[r * width:(r + 1) * width]) for r in range(world)]


def fail(error, status: int = 2):
    """One line on stderr, this rank's process group torn down, then exit with `status`.

    Without the teardown a rank can abort at exit (SIGABRT, "terminate called without an active
    exception") instead of exiting with the status.
    """
    print(f"train.py: error: {error}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def print_line(text: str) -> None:
    """Print a line every rank prints in one write: the launcher runs ranks unbuffered (python -u),
    where print's separate newline lets the lines of ranks sharing a pipe run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main(argv=None) -> dict:
    """Train; returns this rank's summary: logged records, optimizer-state bytes, stage parameter count."""
    job_start = time.perf_counter()
    console_log.configure()
    args = parse_args(argv)
    try:
        plan = prepare(args, int(os.environ.get("WORLD_SIZE", "1")))
    except LayoutError as e:
        fail(e)

    init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()
    layout = plan.layout
    try:
        check_placement(topology(layout.tp, layout.pp, layout.dp, layout.cp))
        memory_lines = check_at_start(plan_memory(RunShape.of_run(
            plan.model, layout, plan.engine_config, args.seq_length // layout.cp, args.partition_method,
            args.checkpoint_activations_interval, args.sequence_parallel)), args.no_memory_check)
        lock = checkpointing.lock_save_dir(args.save) if args.save else None
    except (PlacementError, MemoryPlanError, CheckpointError) as e:
        fail(e)
    if rank == 0:
        print_line("\n".join(memory_lines))
        if plan.deepspeed_line:
            print(plan.deepspeed_line, flush=True)
        for note in plan.data.warnings:
            print(f"train.py: warning: {note}", flush=True)
    try:
        return run_training(args, plan, rank, job_start)
    finally:
        if lock is not None:
            lock.release()


def run_training(args: argparse.Namespace, plan: RunPlan, rank: int, job_start: float) -> dict:
    """The training loop of `main`, after start-up; returns this rank's summary."""
    layout, model_config = plan.layout, plan.model
    load, initial = init_from.sources(args.init_from, args.finetune, args.load)
    try:
        resume = checkpointing.open_for_run(load, args.save, model_config)
        stream = run_stream(plan.data, args.tokenizer) if args.save or resume else None  # what saves record
        run_start = fresh(plan.train_iters, plan.schedule, layout.global_batch_size) if not resume else resumed_run(
            resume, args, stream, layout.global_batch_size, plan.train_iters, plan.schedule, plan.ds_config)
        settings = dataclasses.replace(plan.optimizer, schedule=run_start.schedule)
        start = init_from.open_source(*initial, model_config) if initial and not resume else None
        trainer = build_trainer(layout, model_config, plan.engine_config, settings, args.seed, args.partition_method,
                                args.checkpoint_activations_interval, args.sequence_parallel)
        if args.save or load:
            checkpointing.check_trainer(trainer)
        if resume:
            checkpointing.load(trainer, resume, model_config, not args.no_load_optim, not args.no_load_rng)
        if start:
            init_from.load_weights(trainer, start)
    except CheckpointError as e:
        fail(e)
    stop = StopRequest()
    guard = NonFiniteGuard(trainer.engine, args.max_skipped_steps, args.loss_spike_factor)
    newest = resume.path if resume else None  # the newest checkpoint of this run
    last_good = None  # the newest checkpoint before the first skipped step: retention keeps it
    watchdog = Watchdog(args.step_timeout)
    train, valid = plan.data.train, plan.data.valid
    first_step, train_iters = run_start.step, run_start.train_iters
    logger = MetricsLogger(rank == 0, args.metrics_jsonl, total_steps=train_iters, **plan.monitors._asdict())
    tokens_per_step = layout.global_batch_size * args.seq_length
    flops_per_step = training_flops_per_token(model_config, args.seq_length) * tokens_per_step
    stage_params = sum(full_numel(p) for p in trainer.module.parameters())
    low, high = agree([-stage_params, stage_params], op="max")
    if rank == 0:
        print_line("\n".join(startup_summary(
            model=model_config, layout=layout, seq_length=args.seq_length, train_iters=train_iters,
            schedule=run_start.lr_plan, engine_config=plan.engine_config, data=plan.data,
            total_params=count_parameters(model_config), stage_params=(int(-low), int(high)), save=args.save,
            load=args.load, save_interval=args.save_interval, keep_last=args.keep_last)))
        if resume:
            if run_start.warning:
                print_line(f"train.py: warning: {run_start.warning}")
            print_line(resume_line(resume.path, run_start))
            if initial:
                print_line(f"train.py: {initial[0]} not used: --load found {resume.path} to resume")
        if start:
            print_line(init_from.startup_line(start))

    window = trainer.window(args.seq_length)  # under CP, this rank reads only its slice of every sequence

    def micro_batches(data, step):
        return data.micro_batches(step, trainer.dp_rank, layout.dp, layout.micro_batch_size, window)

    def first_sample(step):  # the data stream is addressed by consumed samples, not by step
        return run_start.consumed_samples + (step - first_step) * layout.global_batch_size

    layout_record = {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "pp": layout.pp}  # each checkpoint's "layout"
    summary = {"records": [], "stage_parameters": stage_params,
               "parameter_dtypes": sorted({str(p.dtype) for p in trainer.module.parameters()})}
    steps_timed, seconds = 0, 0.0
    clock = StepClock(job_start, time.perf_counter(), train_iters)
    for step in range(first_step, train_iters):
        start = time.perf_counter()
        lr = trainer.lr_scheduler.get_last_lr()[0]  # this step's (a skipped step does not advance it)
        batches = train.micro_batches_at(first_sample(step), trainer.dp_rank, layout.dp, layout.micro_batch_size,
                                         window)
        outcome = agree_step(trainer.train_step(batches), guard.nonfinite(), stop.received)
        trainer.finish_step(outcome.applied)
        seconds += time.perf_counter() - start
        steps_timed += 1
        elapsed_s, eta_s = clock.step_done(step)
        if step == 0:  # torch's AdamW allocates its moments in the first step
            summary["optimizer_state_bytes"] = optimizer_state_bytes(trainer.optimizer, trainer.module)
            every_rank = per_rank_values([stage_params, summary["optimizer_state_bytes"]])
            if rank == 0:
                print_line("\n".join(optimizer_state_lines(layout, every_rank)))
        try:
            if guard.after_step(step, outcome) and last_good is None:
                last_good = newest
        except NonFiniteSteps as e:
            fail(f"{e} from {last_good or 'step 0 (no checkpoint was written before the trouble)'}", status=1)
        evaluate = args.eval_interval and ((step + 1) % args.eval_interval == 0 or step == train_iters - 1)
        val_loss = None
        if evaluate:
            val_loss = sum(trainer.eval_loss(micro_batches(valid, i)) for i in range(args.eval_iters)) / args.eval_iters
        if step % args.log_interval == 0 or step == train_iters - 1 or evaluate:
            seconds_per_step = seconds / steps_timed
            steps_timed, seconds = 0, 0.0
            grad_norm = trainer.engine.get_global_grad_norm()
            tflops = flops_per_step / seconds_per_step / layout.world_size / 1e12
            record = {
                "step": step,
                "loss": outcome.loss,
                "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": tokens_per_step / seconds_per_step,
                "tflops_per_device": tflops,
                "mem_peak_gb": peak_memory_gb(),
                "val_loss": val_loss,
                "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
                "elapsed_s": elapsed_s,
                "eta_s": eta_s,
            }
            logger.log(record)
            summary["records"].append({k: v for k, v in record.items() if v is not None})
        stopping = outcome.stop
        if args.save and checkpointing.save_due(step + 1, train_iters, args.save_interval, stopping):
            if guard.in_a_row:
                if rank == 0:
                    print(f"train.py: warning: step {step}: no checkpoint written and none pruned while steps are "
                          f"being skipped ({guard.in_a_row} in a row); the newest stays "
                          f"{newest or 'none'}", flush=True)
            else:
                save_start = time.perf_counter()
                with watchdog.paused():
                    saved = checkpointing.save(trainer, model_config, args.save, step + 1,
                                               scheduler=trainer.lr_scheduler,
                                               extra={"args": vars(args), "layout": layout_record,
                                                      **records(run_start, stream, first_sample(step + 1),
                                                                trainer.lr_scheduler.last_epoch)},
                                               tokenizer=plan.data.tokenizer, keep_last=args.keep_last,
                                               protect=last_good and os.path.basename(last_good))
                newest = os.path.join(args.save, tag_for(step + 1))
                if rank == 0:
                    print_line(f"train.py: saved {saved} after step {step} ({step + 1} steps done) in "
                               f"{time.perf_counter() - save_start:.2f} s")
        if stopping:
            if rank == 0:
                where = (", no --save: nothing saved" if not args.save else f", checkpoint in {args.save}"
                         if not guard.in_a_row else ", no checkpoint written (steps being skipped)")
                print(f"train.py: SIGTERM: stopped after step {step} ({step + 1} steps done){where}", flush=True)
            break
        watchdog.beat()
    logger.close()
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    main()
