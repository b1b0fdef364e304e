"""Train a Mamba LM with DeepSpeed: data x context x tensor x pipeline parallelism, ZeRO, one command.

    deepspeed --num_gpus 8 launch/train.py --deepspeed_config launch/configs/mamba2-130m.json \\
        --model-config launch/models/mamba2-130m.json --pipeline-parallel-size 2 --train-iters 1000

The flags (each group defined beside what it configures) and the DeepSpeed JSON become one run plan
(`prepare`: every check that needs no process group; a failure prints one line and exits with status 2);
once the process group is up `check_start` checks the ranks' placement and memory, then `run_training`
builds the trainer, sets its weights and runs the steps (pipelines/job/run.py). Ctrl-C finishes the
step, saves and exits 130; a second one stops at once (pipelines/loop/faults.py). Flags: docs/flags.md;
engines, data, metrics, checkpoints and resume: docs/training.md.
"""

import argparse
import logging
import os
import sys
import time
import warnings
from typing import NoReturn

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.data.errors import DatasetError
from megamamba.data.training_data import add_data_flags
from megamamba.errors import MegamambaError
from megamamba.observe import console_log
from megamamba.parallel.groups import init_distributed
from megamamba.pipelines.config.ds_translate import add_optimizer_flags
from megamamba.pipelines.config.layout import add_layout_flags
from megamamba.pipelines.config.moe_flags import add_moe_flags
from megamamba.pipelines.config.run_plan import add_run_flags, layout_flags, prepare
from megamamba.pipelines.job.checkpointing import add_checkpoint_flags
from megamamba.pipelines.job.run import check_start, run_training
from megamamba.pipelines.loop.faults import SIGINT_STATUS, NonFiniteSteps, add_fault_flags
from megamamba.pipelines.loop.task_evaluation import add_task_evaluation_flags
from megamamba.pipelines.loop.training import add_loop_flags
from megamamba.pipelines.memory.fit import add_memory_flags
from megamamba.pipelines.planner.for_run import add_planner_flags, auto_parallel

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")  # --auto-parallel's
log = logging.getLogger("megamamba.launch.train")  # shown as `train.py: ...` (megamamba.observe.console_log)

# DeepSpeed's pipeline sends activations with an in-place broadcast where p2p send/recv is not
# available (gloo); autograd then warns once per rank about a node it never differentiates.
warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")


def _parser() -> argparse.ArgumentParser:
    """Our flags, DeepSpeed's (--deepspeed, --deepspeed_config) and Megatron's names for the same settings
    (--tensor-model-parallel-size, --micro-batch-size, --data-path, ...), each group beside what it configures;
    no abbreviations."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    for add_flags in (
        add_run_flags,
        add_moe_flags,
        add_layout_flags,
        add_planner_flags,
        add_optimizer_flags,
        add_data_flags,
        add_loop_flags,
        add_task_evaluation_flags,
        add_checkpoint_flags,
        add_fault_flags,
        add_memory_flags,
    ):
        add_flags(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return _parser().parse_args(argv)


_UNSET = object()


def given_flags(argv=None) -> set:
    """The settings (their dests) that `argv` gives explicitly, defaults left out."""
    marked = argparse.Namespace(**{dest: _UNSET for dest in vars(parse_args(argv))})
    return {dest for dest, value in vars(_parser().parse_args(argv, namespace=marked)).items() if value is not _UNSET}


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
    """Train; returns this rank's summary: logged records, optimizer-state bytes, stage parameter count.
    Ctrl-C anywhere: one line on global rank 0 (what was saved), the process group torn down, exit 130."""
    try:
        return train(argv)
    except KeyboardInterrupt as interrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            log.info(str(interrupt) or "interrupted outside the training steps: stopped at once, no checkpoint written")
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(SIGINT_STATUS)


def train(argv=None) -> dict:
    job_start = time.perf_counter()
    console_log.configure()
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # start-up: a refusal is one line and exit 2
        flags, chosen = (
            auto_parallel(args, given_flags(argv), world_size, PROFILES)
            if args.auto_parallel
            else (layout_flags(args), [])
        )
        plan = prepare(args, world_size, flags)
        if int(os.environ.get("RANK", "0")) == 0:
            for line in chosen:
                log.info(line)
        init_distributed()
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        memory_lines, lock = check_start(args, plan)
    except MegamambaError as e:
        fail(e)
    if dist.get_rank() == 0:
        console_log.show("\n".join(memory_lines))
        if plan.deepspeed_line:
            print(plan.deepspeed_line, flush=True)
        for note in plan.data.warnings:
            log.warning(note)
    try:
        return run_training(args, plan, job_start)
    except (NonFiniteSteps, DatasetError) as e:  # DatasetError here: a .bin changed after start-up checked it
        fail(e, status=1)
    except MegamambaError as e:
        fail(e)
    finally:
        if lock is not None:
            lock.release()


def exit_without_teardown(status) -> NoReturn:
    """Flush what the run wrote and leave: the interpreter's teardown of torch's modules and objects costs
    each rank about 1.5 s of CPU (torch 2.13, DeepSpeed 0.19.8) and nothing in it is needed once the run has
    closed its files."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            exit_without_teardown(stop.code or 0)
        print(stop.code, file=sys.stderr)  # as Python prints a message given to sys.exit, exit 1
        exit_without_teardown(1)
    exit_without_teardown(0)
