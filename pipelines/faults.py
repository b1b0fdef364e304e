"""What a training run does when something goes wrong: SIGTERM, non-finite steps, a stalled rank.

SIGTERM (what a scheduler, or the deepspeed launcher forwarding one, sends before a kill):
`StopRequest` only sets a flag; at every step boundary the ranks all-reduce it, so they all stop
after the same step, write a checkpoint and exit 0.

Non-finite steps: a step whose gradients hold a NaN/inf is not applied (no parameter or Adam
update, the LR schedule does not advance; the batch is consumed). DeepSpeed's ZeRO-1/2 optimizer
already does this when the global gradient norm it computes for clipping is not finite; without
ZeRO, `NonFiniteGuard` wraps torch's AdamW step: every rank checks its gradients and the ranks
agree through an all-reduce. Either way the engine counts the step in `skipped_steps`, which the
guard reads to warn and to abort after `max_in_a_row` consecutive skips.

Stalls: `Watchdog` ends the process (exit 1) when no step boundary is reached within `timeout`
seconds, so a rank stuck in a collective with a vanished peer cannot hang the job; it is armed
after the first step (first-time op builds happen before) and paused around saves (an evaluation
counts toward the step it follows).

Test hook: MEGAMAMBA_TEST_NAN_STEPS="3,4" turns the gradient of the first parameter of global
rank 0 to NaN in those (0-based) steps.
"""
import contextlib
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

NAN_HOOK = "MEGAMAMBA_TEST_NAN_STEPS"


def check_max_skipped_steps(max_in_a_row: int) -> None:
    if max_in_a_row < 1:
        raise ValueError(f"--max-skipped-steps {max_in_a_row}: must be >= 1")


def check_step_timeout(timeout: float) -> None:
    if timeout < 0:
        raise ValueError(f"--step-timeout {timeout}: must be >= 0 (0: off)")


class StopRequest:
    """SIGTERM -> a flag all ranks agree on at the next step boundary."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def agreed(self) -> bool:
        """True on every rank when any rank has received SIGTERM (collective)."""
        flag = torch.tensor([1.0 if self.received else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class NonFiniteSteps(RuntimeError):
    """Too many consecutive steps were skipped for non-finite gradients or loss."""


class NonFiniteGuard:
    """Skips non-finite steps (see module docstring) and counts them in a row."""

    def __init__(self, engine, module: torch.nn.Module, max_in_a_row: int):
        check_max_skipped_steps(max_in_a_row)
        self.engine, self.max_in_a_row, self.in_a_row = engine, max_in_a_row, 0
        self._skipped_before = engine.skipped_steps
        if isinstance(engine.optimizer, torch.optim.Optimizer) and not engine.zero_optimization():
            self._wrap_step(engine.optimizer)
        self._install_nan_hook(module)

    @staticmethod
    def _wrap_step(optimizer: torch.optim.Optimizer) -> None:
        original = optimizer.step

        def step(*args, **kwargs):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            bad = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            optimizer.overflow = bool(bad.item())  # the engine then skips the LR step and counts skipped_steps
            if not optimizer.overflow:
                return original(*args, **kwargs)
            optimizer.zero_grad(set_to_none=True)
            return None

        optimizer.step = step

    def _install_nan_hook(self, module: torch.nn.Module) -> None:
        spec = os.environ.get(NAN_HOOK)
        if not spec or dist.get_rank() != 0:
            return
        steps = {int(s) for s in spec.split(",")}
        first = next(p for p in module.parameters() if p.requires_grad)
        first.register_hook(lambda g: torch.full_like(g, math.nan) if self.engine.global_steps in steps else g)

    def after_step(self, step: int, loss: float) -> bool:
        """Whether `step` was skipped; warns on rank 0; NonFiniteSteps after max_in_a_row in a row."""
        skipped = self.engine.skipped_steps > self._skipped_before or not math.isfinite(loss)
        self._skipped_before = self.engine.skipped_steps
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped and dist.get_rank() == 0:
            print(f"train.py: warning: step {step}: non-finite loss or gradients (loss {loss}); step skipped, "
                  f"{self.in_a_row} in a row (limit --max-skipped-steps {self.max_in_a_row})", flush=True)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(f"{self.in_a_row} steps in a row up to step {step} had non-finite loss or "
                                 "gradients; lower the learning rate or resume from an earlier checkpoint")
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
                rank = dist.get_rank() if dist.is_initialized() else 0
                print(f"train.py: error: rank {rank}: no training step finished in {self.timeout:g} s "
                      "(--step-timeout): a peer has probably died; exiting", file=sys.stderr, flush=True)
                os._exit(1)
