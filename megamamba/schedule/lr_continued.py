"""An LR plan written in steps of one global batch size, continued after a resume at another.

Megatron plans the LR of a sample-based run in samples; ours is planned in steps (lr_schedule.py),
so after a resume that changes the global batch from B to B' each optimizer step moves the plan
on by B'/B of its steps: the LR keeps following the samples consumed, and a --train-samples run
still reaches its minimum at its last sample. Scheduler epoch e (optimizer steps applied) runs
the plan at position p0 + (e - e0) * B'/B, where the resume restored epoch e0 at position p0.
"""

from fractions import Fraction

import torch


class ContinuedSchedule:
    """`plan` (an LRSchedule or DeepSpeedSchedule) continued at another global batch size; reads as `plan`."""

    def __init__(self, plan, plan_batch: int, batch: int, epoch: int, position: Fraction):
        self.plan, self.ratio = plan, Fraction(batch, plan_batch)
        self.epoch, self.start = epoch, Fraction(position)

    def position(self, epoch: int) -> Fraction:
        """The plan's step that scheduler epoch `epoch` runs."""
        return self.start + (epoch - self.epoch) * self.ratio

    def __call__(self, epoch: int) -> float:
        position = self.position(epoch)
        return self.plan(int(position) if position.denominator == 1 else float(position))

    def __getattr__(self, name):
        if name == "plan":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A scheduler setting every group's lr to this schedule; the groups' lr must be the plan's peak."""
        for group in optimizer.param_groups:
            if group.get("initial_lr", group["lr"]) != self.peak:
                raise ValueError(f"optimizer group lr {group['lr']} differs from the schedule's peak {self.peak}")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: self(epoch) / self.peak)


def plan_position(schedule, epoch: int) -> Fraction:
    """The plan's step that scheduler epoch `epoch` runs: the epoch itself unless the schedule was continued."""
    return schedule.position(epoch) if isinstance(schedule, ContinuedSchedule) else Fraction(epoch)
