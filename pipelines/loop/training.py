"""A run's steps after start-up: each one trained, evaluated and logged when due, then saved when due.

`launch/train.py` builds the trainer and hands it here with the run's settings; NonFiniteSteps
(too many skipped steps in a row) ends the run with the checkpoint to restart from, and Interrupted
(Ctrl-C, pipelines/loop/faults.py) with what was saved.
"""

import argparse
import logging
import os
import time
from typing import NamedTuple, Optional

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.checkpoint import tag_for
from megamamba.checkpoint.store import read_latest
from megamamba.config import MambaConfig
from megamamba.model.flops import training_flops_per_token
from megamamba.observe import console_log
from megamamba.observe.metrics import MetricsLogger
from megamamba.observe.monitor_config import Monitors
from megamamba.observe.run_console import StepClock, optimizer_state_lines
from megamamba.pipelines.config.layout import Layout
from megamamba.pipelines.job import checkpointing
from megamamba.pipelines.job.resume import records
from megamamba.pipelines.loop.agreement import agree
from megamamba.pipelines.loop.engine import Trainer
from megamamba.pipelines.loop.faults import (
    Interrupted,
    NonFiniteGuard,
    NonFiniteSteps,
    StopRequest,
    Watchdog,
    agree_step,
)
from megamamba.pipelines.loop.moe_metrics import moe_metrics
from megamamba.pipelines.loop.task_evaluation import TaskEvaluations, TaskSettings

log = logging.getLogger(__name__)


class LoopSettings(NamedTuple):
    """What the loop takes from the run's flags."""

    seq_length: int
    log_interval: int
    eval_interval: int
    eval_iters: int
    save: Optional[str]
    save_interval: int
    keep_last: Optional[int]
    peak_tflops: Optional[float]
    metrics_jsonl: Optional[str]
    max_skipped_steps: int
    loss_spike_factor: Optional[float]
    step_timeout: Optional[float]
    eval_tasks: Optional[TaskSettings]  # lm-eval tasks on each evaluation step's checkpoint (--eval-tasks)
    flags: dict  # every flag of the run, as each checkpoint records them


class StartedRun(NamedTuple):
    trainer: Trainer  # `build_trainer`'s, its weights loaded
    resume: Optional[object]  # the checkpoint resumed from, or None
    run_start: object  # where the run starts (`fresh` / `resumed_run`)
    stream: Optional[dict]  # the data stream each checkpoint records (None without --save or a resume)
    initial: Optional[tuple]  # (flag, folder) of --init-from / --finetune, or None
    source: Optional[object]  # the opened --init-from source the weights came from (None on a resume)


def peak_memory_gb() -> float:
    """Largest peak of device memory (host RSS on CPU) over all ranks, GiB (collective)."""
    return agree([get_accelerator().max_memory_allocated() / 2**30], op="max")[0]


def per_rank_values(values: list) -> list:
    """Every rank's `values` (small integers), in rank order, in one collective; a tuple per rank."""
    world, rank, width = dist.get_world_size(), dist.get_rank(), len(values)
    slots = [0] * (world * width)
    slots[rank * width : (rank + 1) * width] = values
    reduced = agree(slots)
    return [tuple(int(v) for v in reduced[r * width : (r + 1) * width]) for r in range(world)]


class TrainingLoop:
    """The steps of a run after start-up: each one trained, evaluated and logged when due, then saved
    when due; global rank 0 logs."""

    def __init__(
        self,
        settings: LoopSettings,
        model: MambaConfig,
        layout: Layout,
        data,
        monitors: Monitors,
        run: StartedRun,
        job_start: float,
    ):
        self.settings, self.model, self.data, self.layout = settings, model, data, layout
        self.trainer, self.run_start, self.stream, self.rank = run.trainer, run.run_start, run.stream, dist.get_rank()
        self.first_step, self.train_iters = run.run_start.step, run.run_start.train_iters
        self.stop = StopRequest()
        self.guard = NonFiniteGuard(self.trainer, settings.max_skipped_steps, settings.loss_spike_factor)
        self.watchdog = Watchdog(settings.step_timeout)
        self.newest = run.resume.path if run.resume else None  # the newest checkpoint of this run
        self.last_good = None  # the newest checkpoint before the first skipped step: retention keeps it
        self.logger = MetricsLogger(
            self.rank == 0, settings.metrics_jsonl, total_steps=self.train_iters, **monitors._asdict()
        )
        self.tokens_per_step = layout.global_batch_size * settings.seq_length
        self.flops_per_step = training_flops_per_token(model, settings.seq_length) * self.tokens_per_step
        self.stage_params = self.trainer.stage_parameter_count()
        self.window = self.trainer.window(settings.seq_length)  # under CP, this rank's slice of each sequence
        self.summary = {"records": [], "stage_parameters": self.stage_params}
        self.steps_timed, self.seconds = 0, 0.0
        self.clock = StepClock(job_start, time.perf_counter(), self.train_iters)
        self.tasks = TaskEvaluations(settings.eval_tasks, settings.save, self.rank)

    def first_sample(self, step: int) -> int:
        """The global sample where `step`'s batch starts: the stream is addressed by consumed samples."""
        return self.run_start.consumed_samples + (step - self.first_step) * self.layout.global_batch_size

    def micro_batches(self, data, first_sample: int) -> list:
        """This rank's micro-batches of the global batch at `first_sample` of `data` (its slice under CP)."""
        return data.micro_batches_at(
            first_sample, self.trainer.dp_rank, self.layout.dp, self.layout.micro_batch_size, self.window
        )

    def step(self, step: int):
        """One optimizer step: its agreed outcome (loss, applied, stop) and (elapsed, eta) seconds."""
        step_start = time.perf_counter()
        outcome = agree_step(
            self.trainer.train_step(self.micro_batches(self.data.train, self.first_sample(step))),
            self.guard.nonfinite(),
            self.stop,
        )
        self.trainer.finish_step(outcome.applied)
        self.seconds += time.perf_counter() - step_start
        self.steps_timed += 1
        elapsed = self.clock.step_done(step)
        if step == 0:  # torch's AdamW allocates its moments in the first step
            self.summary["optimizer_state_bytes"] = self.trainer.optimizer_state_bytes()
            every_rank = per_rank_values([self.stage_params, self.summary["optimizer_state_bytes"]])
            if self.rank == 0:
                console_log.show("\n".join(optimizer_state_lines(self.layout, every_rank)))
        try:
            if self.guard.after_step(step, outcome) and self.last_good is None:
                self.last_good = self.newest
        except NonFiniteSteps as e:
            restart = self.last_good or "step 0 (no checkpoint was written before the trouble)"
            raise NonFiniteSteps(f"{e} from {restart}") from None
        return outcome, elapsed

    def evaluation_due(self, step: int) -> bool:
        interval = self.settings.eval_interval
        return bool(interval) and ((step + 1) % interval == 0 or step == self.train_iters - 1)

    def evaluate(self) -> float:
        """The validation loss: the mean over eval_iters global batches from the start of the validation data."""
        valid, iters = self.data.valid, self.settings.eval_iters
        return (
            sum(self.trainer.eval_loss(self.micro_batches(valid, i * valid.global_batch_size)) for i in range(iters))
            / iters
        )

    def log(self, step: int, lr: float, outcome, val_loss: Optional[float], elapsed: tuple) -> None:
        """One metrics record, timed over the steps since the last one."""
        seconds_per_step = self.seconds / self.steps_timed
        self.steps_timed, self.seconds = 0, 0.0
        tflops = self.flops_per_step / seconds_per_step / self.layout.world_size / 1e12
        record = {
            "step": step,
            "loss": outcome.loss,
            "lr": lr,
            "grad_norm": self.trainer.grad_norm(),
            "tokens_per_s": self.tokens_per_step / seconds_per_step,
            "tflops_per_device": tflops,
            "mem_peak_gb": peak_memory_gb(),
            "val_loss": val_loss,
            "mfu": tflops / self.settings.peak_tflops if self.settings.peak_tflops else None,
            **moe_metrics(self.model, self.trainer),
            "elapsed_s": elapsed[0],
            "eta_s": elapsed[1],
        }
        self.logger.log(record)
        self.summary["records"].append({k: v for k, v in record.items() if v is not None})

    def maybe_save(self, step: int, stopping: bool) -> bool:
        """A checkpoint after `step` when one is due, unless steps are being skipped; whether one was written."""
        settings = self.settings
        if not (settings.save and checkpointing.save_due(step + 1, self.train_iters, settings.save_interval, stopping)):
            return False
        if self.guard.in_a_row:
            if self.rank == 0:
                log.warning(
                    f"step {step}: no checkpoint written and none pruned while steps are being skipped "
                    f"({self.guard.in_a_row} in a row); the newest stays {self.newest or 'none'}"
                )
            return False
        save_start = time.perf_counter()
        layout = self.layout
        extra = {
            "args": settings.flags,
            "layout": {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep},
            **records(self.run_start, self.stream, self.first_sample(step + 1), self.trainer.scheduler_epoch()),
        }
        try:
            with self.watchdog.paused():
                saved = checkpointing.save(
                    self.trainer,
                    self.model,
                    settings.save,
                    step + 1,
                    extra=extra,
                    tokenizer=self.data.tokenizer,
                    keep_last=settings.keep_last,
                    protect=self.last_good and os.path.basename(self.last_good),
                )
        except Interrupted:
            ending = "had finished" if read_latest(settings.save) == tag_for(step + 1) else "was abandoned"
            where = self.newest_saved()
            raise Interrupted(f"interrupted again: the save at step {step + 1} {ending}; {where}") from None
        self.newest = os.path.join(settings.save, tag_for(step + 1))
        if self.rank == 0:
            log.info(
                f"saved {saved} after step {step} ({step + 1} steps done) in {time.perf_counter() - save_start:.2f} s"
            )
        return True

    def report_stop(self, step: int) -> None:
        if self.rank == 0:
            where = (
                ", no --save: nothing saved"
                if not self.settings.save
                else f", checkpoint in {self.settings.save}"
                if not self.guard.in_a_row
                else ", no checkpoint written (steps being skipped)"
            )
            log.info(f"SIGTERM: stopped after step {step} ({step + 1} steps done){where}")

    def newest_saved(self) -> str:
        """Where a run stopped at once can be resumed from (read on disk: a save may have committed)."""
        save = self.settings.save
        if not save:
            return "nothing saved (no --save)"
        latest = read_latest(save)
        if latest is None:
            return f"no checkpoint in {save} yet"
        return f"{os.path.join(save, latest)} is the newest checkpoint; resume with --load {save}"

    def interrupted(self, step: int) -> Interrupted:
        """Ctrl-C after `step`, the checkpoint (if any) written: what was saved."""
        done, save = step + 1, self.settings.save
        if not save:
            return Interrupted(f"interrupted at step {done}; nothing saved: the run has no --save")
        if self.guard.in_a_row:
            return Interrupted(
                f"interrupted at step {done}; no checkpoint written while steps are being skipped "
                f"({self.guard.in_a_row} in a row); {self.newest_saved()}"
            )
        return Interrupted(f"interrupted at step {done}, saved to {self.newest}; resume with --load {save}")

    def run(self) -> dict:
        """Every step from the first to the last, or to a SIGTERM; this rank's summary (evaluations of
        --eval-tasks may still run after the last step: `tasks.poll(wait=True)`; a SIGTERM stops them).
        Interrupted on Ctrl-C: after the step and its checkpoint, or at once on a second one; then, as on any
        error, evaluations still running are stopped."""
        step = self.first_step
        try:
            for step in range(self.first_step, self.train_iters):
                lr = self.trainer.learning_rate()  # this step's (a skipped step does not advance it)
                outcome, elapsed = self.step(step)
                evaluating = self.evaluation_due(step)
                val_loss = self.evaluate() if evaluating else None
                if step % self.settings.log_interval == 0 or step == self.train_iters - 1 or evaluating:
                    self.log(step, lr, outcome, val_loss, elapsed)
                if self.maybe_save(step, outcome.stop) and evaluating:
                    self.tasks.start(tag_for(step + 1))
                self.tasks.poll()
                if outcome.interrupted:
                    raise self.interrupted(step)
                if outcome.stop:
                    self.report_stop(step)
                    self.tasks.stop()  # a scheduler's grace period is no time to wait for evaluations
                    break
                self.watchdog.beat()
        except Interrupted as e:
            self.tasks.stop()
            if e.args:
                raise
            raise Interrupted(f"interrupted again during step {step}: stopped at once; {self.newest_saved()}") from None
        except BaseException:
            self.tasks.stop()
            raise
        finally:
            self.stop.release()
            self.logger.close()
        return self.summary


def add_loop_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's logging and evaluation flags, read into `LoopSettings` (docs/flags.md)."""
    p = parser.add_argument_group("logging and evaluation")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--eval-interval", type=int, default=0, help="validation every this many steps (0: never)")
    p.add_argument("--eval-iters", type=int, default=4, help="validation global batches per evaluation")
    p.add_argument("--log-dir", default=None, help="TensorBoard directory")
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON object per logged step")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak TFLOP/s, for MFU")
