"""Where a resumed run continues: step, consumed samples, total steps and LR plan, and what changed.

The checkpoint's records (megamamba.checkpoint.run_record) say how many samples the run consumed
and what its stream and LR plan were. A resume at another global batch size continues the sample
stream at the consumed count and the step counter at the checkpoint's step; a --train-samples run
keeps its total samples (steps left = samples left / the new global batch), and its LR plan,
written in steps of the batch it was planned at, moves on by the samples each step now consumes
(megamamba.schedule.lr_continued). A changed stream or LR plan is refused unless overridden. Megatron's
--no-load-optim starts a fresh optimizer and LR schedule; --no-load-rng keeps this run's RNG.
"""

from fractions import Fraction
from typing import NamedTuple, Optional

from megamamba.checkpoint import Checkpoint, CheckpointError
from megamamba.checkpoint.run_record import (
    LR_PLAN,
    OVERRIDE_SCHEDULE,
    STREAM,
    check_lr_plan,
    lr_plan_record,
    resume_point,
    saved_position,
    stream_record,
)
from megamamba.pipelines.config.ds_translate import OptimizerFlags, optimizer_settings
from megamamba.pipelines.config.layout import LayoutError
from megamamba.schedule.lr_continued import ContinuedSchedule, plan_position


class RunStart(NamedTuple):
    """Where a run starts (step 0 afresh, or where its checkpoint stopped) and what it follows from there."""

    step: int  # the first step this run takes
    consumed_samples: int  # the global sample it starts at
    train_iters: int  # the step it ends before
    schedule: object  # the LR schedule the trainer steps (continued when the batch changed)
    lr_plan: object  # the plan the checkpoint records (`schedule` itself unless continued)
    plan_batch: int  # the global batch the plan's steps were written for
    notes: list  # what the resume line adds: what changed, what was not loaded
    warning: Optional[str]


class ResumeFlags(NamedTuple):
    """The flags that say how a run continues a checkpoint (Megatron's names)."""

    train_samples: Optional[int]
    override_data_check: bool
    override_opt_param_scheduler: bool
    no_load_optim: bool
    no_load_rng: bool
    optimizer: OptimizerFlags  # to re-plan the LR schedule at the checkpoint's global batch size


def fresh(train_iters: int, schedule, global_batch: int) -> RunStart:
    return RunStart(0, 0, train_iters, schedule, schedule, global_batch, [], None)


def run_stream(data, tokenizer_spec: str) -> dict:
    """The stream record of a run on `data` (TrainingData) at sample 0, computed once at start-up: its blend
    identity reads a sampled fingerprint of every dataset, too costly for every save on shared storage."""
    return stream_record(data.train, data.tokenizer, tokenizer_spec, 0)


def resumed_run(
    checkpoint: Checkpoint,
    flags: ResumeFlags,
    stream: dict,
    global_batch: int,
    train_iters: int,
    schedule,
    ds_config: dict,
) -> RunStart:
    """The continuation of `checkpoint` by a run with these flags, `stream` (its run_stream) and global batch.

    CheckpointError (same on every rank, one message) for a refused change of stream or LR plan.
    """
    point = resume_point(checkpoint.extra, checkpoint.step, stream, flags.override_data_check, checkpoint.path)
    if flags.train_samples is not None:
        train_iters = point.step + max(0, flags.train_samples - point.consumed_samples) // global_batch
    notes = list(point.changes)
    if flags.no_load_optim:
        notes.append("fresh optimizer state and LR schedule (--no-load-optim)")
        lr_plan, plan_batch = schedule, global_batch
    else:
        lr_plan, plan_batch, schedule, changes = _continued_lr(checkpoint, flags, global_batch, schedule, ds_config)
        notes += changes
    if flags.no_load_rng:
        notes.append("RNG states not restored (--no-load-rng)")
    return RunStart(
        point.step, point.consumed_samples, train_iters, schedule, lr_plan, plan_batch, notes, point.warning
    )


def _continued_lr(checkpoint: Checkpoint, flags: ResumeFlags, global_batch: int, schedule, ds_config: dict) -> tuple:
    """(plan, plan batch, schedule to step, notes) of a resume that restores the optimizer and scheduler."""
    saved = checkpoint.extra.get(LR_PLAN)
    stream = checkpoint.extra.get(STREAM)
    plan_batch = saved["global_batch_size"] if saved else stream["global_batch_size"] if stream else global_batch
    if flags.train_samples is not None and plan_batch != global_batch:  # the plan's steps are of plan_batch
        try:
            iters = flags.train_samples // plan_batch
            schedule = optimizer_settings(ds_config, flags.optimizer, iters).optimizer.schedule
        except LayoutError as e:
            raise CheckpointError(f"the LR plan at the checkpoint's global batch {plan_batch}: {e}") from None
    notes = []
    if saved:
        notes = [
            f"LR plan overridden ({OVERRIDE_SCHEDULE}): {d}"
            for d in check_lr_plan(saved, schedule, flags.override_opt_param_scheduler, checkpoint.path)
        ]
    epoch = (checkpoint.scheduler or {}).get("last_epoch", checkpoint.step)
    position = saved_position(saved) if saved else Fraction(epoch)
    if plan_batch == global_batch and position == epoch:
        return schedule, plan_batch, schedule, notes
    return schedule, plan_batch, ContinuedSchedule(schedule, plan_batch, global_batch, epoch, position), notes


def resume_line(path: str, resumed: RunStart) -> str:
    """The one line a resume logs (global rank 0)."""
    notes = f" ({'; '.join(resumed.notes)})" if resumed.notes else ""
    return (
        f"resumed from {path}: next step {resumed.step} of {resumed.train_iters}, "
        f"next sample {resumed.consumed_samples}{notes}"
    )


def records(resumed: RunStart, stream: dict, consumed_samples: int, scheduler_epoch: int) -> dict:
    """The checkpoint's `extra` records of a run with `stream` (its run_stream) after `consumed_samples`
    samples, the scheduler at `scheduler_epoch`."""
    position = plan_position(resumed.schedule, scheduler_epoch)
    return {
        STREAM: {**stream, "consumed_samples": consumed_samples},
        LR_PLAN: lr_plan_record(resumed.lr_plan, resumed.plan_batch, position),
    }
