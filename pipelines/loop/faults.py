"""What a training run does when something goes wrong: SIGTERM, Ctrl-C, non-finite steps, a stalled rank.

Every step ends with one agreement (`agree_step`, the step's only host synchronization): the
global batch's mean loss, whether the optimizer step was applied, and whether any rank received
SIGTERM or SIGINT, all in one all-reduce on the device.

SIGTERM (what a scheduler, or the deepspeed launcher forwarding one, sends before a kill) and a
first SIGINT (Ctrl-C, which the terminal sends to every rank): `StopRequest` only sets a flag; the
step agreement carries it, so all ranks stop after the same step and write a checkpoint. SIGTERM
then exits 0; SIGINT ends with `Interrupted` (exit status 130, as a shell reports a Ctrl-C'd
command). A second SIGINT raises `Interrupted` at once, wherever the rank is: a save in progress
is abandoned (`latest` still names the previous checkpoint).

Non-finite steps: a step whose gradients hold a NaN/inf is not applied (no parameter or Adam
update, the LR schedule does not advance; the batch is consumed). DeepSpeed's ZeRO-1/2 optimizer
already does this when the global gradient norm it computes for clipping is not finite; without
ZeRO, `NonFiniteGuard` wraps the fused AdamW step: the ranks agree on a device-side flag, and
the fused kernel skips its update where the flag is set (its `found_inf`), so nothing waits for
the host. The guard warns, and aborts after `max_in_a_row` consecutive skips.

Loss spikes (`--loss-spike-factor K`): a step whose finite loss exceeds K x the median of the
last SPIKE_WINDOW losses counts as a skipped step for saving (train.py writes no checkpoint
and prunes nothing while any step in a row was skipped) and toward `max_in_a_row`. Its update
has been applied: the loss is known on the host only at the step's agreement, after the
optimizer ran, and deciding before the update would cost a second host synchronization per
step (or a device-side median inside DeepSpeed's ZeRO step, which has no hook for it).

Stalls: `Watchdog` ends the process (exit 1) when no step boundary is reached within `timeout`
seconds, so a rank stuck in a collective with a vanished peer cannot hang the job; it is armed
after the first step (first-time op builds happen before) and paused around saves (an evaluation
counts toward the step it follows).
"""

import argparse
import contextlib
import logging
import math
import os
import signal
import statistics
import threading
import time
from collections import deque
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from megamamba.errors import MegamambaError
from megamamba.pipelines.deepspeed_internals import set_found_inf, wrap_optimizer_step
from megamamba.pipelines.loop.agreement import agree

log = logging.getLogger(__name__)
SPIKE_WINDOW, SPIKE_MIN_HISTORY = 32, 8  # losses the median runs over; none is judged before this many


def check_max_skipped_steps(max_in_a_row: int) -> None:
    if max_in_a_row < 1:
        raise ValueError(f"--max-skipped-steps {max_in_a_row}: must be >= 1")


def check_loss_spike_factor(factor: Optional[float]) -> None:
    if factor is not None and not factor > 1:
        raise ValueError(
            f"--loss-spike-factor {factor}: must be > 1 (a loss above factor x the running median is a spike)"
        )


def check_step_timeout(timeout: float) -> None:
    if timeout < 0:
        raise ValueError(f"--step-timeout {timeout}: must be >= 0 (0: off)")


SIGINT_STATUS = 130  # 128 + SIGINT: the exit status of a run ended by Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended the run; its message (when it has one) says what was saved. launch/train.py prints it
    on global rank 0 and exits SIGINT_STATUS."""


class StopRequest:
    """SIGTERM or a first SIGINT -> a flag, agreed at the end of the step (`agree_step`); a second SIGINT
    raises `Interrupted` (no message) wherever the rank is. `release()` puts the previous handlers back."""

    def __init__(self):
        self.terminated = self.interrupted = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if signum == signal.SIGTERM:
            self.terminated = True
        elif self.interrupted:
            raise Interrupted()
        else:
            self.interrupted = True

    def release(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


class StepOutcome(NamedTuple):
    loss: float  # mean over the global batch
    applied: bool  # the optimizer updated the parameters (the LR schedule advances)
    stop: bool  # some rank received SIGTERM or SIGINT
    interrupted: bool  # some rank received SIGINT


def agree_step(loss: torch.Tensor, nonfinite: Union[bool, torch.Tensor], stop: StopRequest) -> StepOutcome:
    """What every rank needs to know after a step, in one all-reduce and one host synchronization.

    `loss`: this rank's share of the global batch's mean loss (a device tensor), the same on every
    rank of a data-parallel replica; `nonfinite`: `NonFiniteGuard.nonfinite()`; `stop`: this rank's
    signals. Collective.
    """
    world = dist.get_world_size()
    loss_sum, nonfinite_sum, terms, interrupts = agree([loss / world, nonfinite, stop.terminated, stop.interrupted])
    return StepOutcome(loss_sum, nonfinite_sum == 0, terms + interrupts > 0, interrupts > 0)


class NonFiniteSteps(MegamambaError, RuntimeError):
    """Too many consecutive steps were skipped for non-finite gradients or loss, or loss spikes."""


class LossSpikes:
    """Whether a loss exceeds `factor` x the median of the recent losses it was given (None: never)."""

    def __init__(self, factor: Optional[float]):
        check_loss_spike_factor(factor)
        self.factor, self.recent = factor, deque(maxlen=SPIKE_WINDOW)

    def threshold(self) -> Optional[float]:
        if self.factor is None or len(self.recent) < SPIKE_MIN_HISTORY:
            return None
        return self.factor * statistics.median(self.recent)

    def is_spike(self, loss: float) -> bool:
        """Judge `loss`; a loss that is no spike joins the history."""
        limit = self.threshold()
        if limit is not None and loss > limit:
            return True
        self.recent.append(loss)
        return False


class NonFiniteGuard:
    """Skips non-finite steps, flags loss spikes (see module docstring) and counts both in a row."""

    def __init__(self, trainer, max_in_a_row: int, spike_factor: Optional[float] = None):
        check_max_skipped_steps(max_in_a_row)
        self.trainer, self.max_in_a_row, self.in_a_row = trainer, max_in_a_row, 0
        self.spikes = LossSpikes(spike_factor)
        self._skipped_before = trainer.skipped_steps()
        self._found_inf = None
        optimizer = trainer.optimizer_without_zero()
        if optimizer is not None:
            self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not optimizer.defaults.get("fused"):
            raise ValueError(
                f"skipping non-finite steps without ZeRO needs a fused optimizer (found_inf), got "
                f"{type(optimizer).__name__} with fused={optimizer.defaults.get('fused')}"
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def flag_nonfinite():
            grads = [p.grad for p in params if p.grad is not None]
            norms = torch.stack(torch._foreach_norm(grads)) if grads else torch.zeros(1, device=params[0].device)
            found_inf = norms.isfinite().all().logical_not().float()
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
            set_found_inf(optimizer, found_inf)
            self._found_inf = found_inf

        wrap_optimizer_step(optimizer, flag_nonfinite)

    def nonfinite(self) -> Union[bool, torch.Tensor]:
        """Whether this step was skipped: ZeRO's count (host), else the flag the fused step used (device)."""
        if self._found_inf is not None:
            found_inf, self._found_inf = self._found_inf, None
            return found_inf
        skipped = self.trainer.skipped_steps() > self._skipped_before
        self._skipped_before = self.trainer.skipped_steps()
        return skipped

    def after_step(self, step: int, outcome: StepOutcome) -> bool:
        """Whether `step` counts as skipped (non-finite, or a loss spike); warns on rank 0;
        NonFiniteSteps after max_in_a_row in a row."""
        nonfinite = not outcome.applied or not math.isfinite(outcome.loss)
        limit = self.spikes.threshold()
        spike = not nonfinite and self.spikes.is_spike(outcome.loss)
        skipped = nonfinite or spike
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped and dist.get_rank() == 0:
            what = (
                f"non-finite loss or gradients (loss {outcome.loss}); step skipped"
                if nonfinite
                else f"loss spike: {outcome.loss:.4g} > {limit:.4g} (--loss-spike-factor x the running median); "
                "counted as skipped"
            )
            log.warning(
                f"step {step}: {what}, {self.in_a_row} in a row (limit --max-skipped-steps {self.max_in_a_row})"
            )
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(
                f"{self.in_a_row} steps in a row up to step {step} had non-finite loss or "
                "gradients or a loss spike; lower the learning rate and resume"
            )
        return skipped


class Watchdog:
    """Exit 1 when no `beat()` comes within `timeout` seconds (0: off); armed by the first beat."""

    def __init__(self, timeout: float):
        check_step_timeout(timeout)
        self.timeout, self._last, self._paused = timeout, None, 0
        if timeout:
            threading.Thread(target=self._watch, daemon=True, name="megamamba-watchdog").start()

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """No deadline inside (saves); the clock restarts after."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def _watch(self) -> None:
        while True:
            time.sleep(min(self.timeout / 4, 5.0))
            last = self._last
            if last is not None and not self._paused and time.monotonic() - last > self.timeout:
                log.error(
                    f"no training step finished in {self.timeout:g} s (--step-timeout): a peer has "
                    "probably died; exiting"
                )
                os._exit(1)


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's flags for skipped steps and stalls (docs/flags.md)."""
    p = parser.add_argument_group("faults")
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
