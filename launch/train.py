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
import logging
import os
import sys
import time
import warnings
from typing import NoReturn

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.checkpoint import CheckpointError
from megamamba.observe import console_log
from megamamba.parallel.groups import init_distributed, topology
from megamamba.parallel.placement import PlacementError, check_placement
from megamamba.pipelines.config.layout import (
    LayoutError,
    LayoutFlags,
)
from megamamba.pipelines.config.run_plan import layout_flags, model_config, prepare, read_deepspeed_config
from megamamba.pipelines.job import checkpointing
from megamamba.pipelines.job.run import run_training
from megamamba.pipelines.loop.faults import (
    NonFiniteSteps,
)
from megamamba.pipelines.memory.fit import MemoryPlanError, check_at_start
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from megamamba.pipelines.planner.for_run import choice_lines, choose, default_profile
from megamamba.pipelines.planner.profile import ProfileError, load_profile
from megamamba.pipelines.planner.search import PlanError
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION
from megamamba.schedule.lr_schedule import DECAY_STYLES

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
    ds_config = flags.with_batch(read_deepspeed_config(args.deepspeed_config))
    model = model_config(args.model_config, args.hybrid_layer_pattern)
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


def fail(error, status: int = 2) -> NoReturn:
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
    except CheckpointError as e:
        fail(e)
    except NonFiniteSteps as e:
        fail(e, status=1)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main()
