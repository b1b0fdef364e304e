"""Learning-rate schedule: linear warm-up to the peak, then cosine, linear or constant decay.

Step s (0-based, the optimizer step about to run) gets
    warm-up (s < warmup_iters):  peak * (s + 1) / warmup_iters
    afterwards, p = (s - warmup_iters) / (total_iters - warmup_iters) clipped to [0, 1]:
        cosine:   minimum + (peak - minimum) * (1 + cos(pi * p)) / 2
        linear:   minimum + (peak - minimum) * (1 - p)
        constant: peak
The schedule is a pure function of the step, so a run restarted at step s continues it exactly.
"""
import math
from dataclasses import dataclass

import torch

DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    minimum: float
    warmup_iters: int
    total_iters: int
    decay_style: str = "cosine"

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.decay_style!r}: choose one of {DECAY_STYLES}")
        if not self.peak > 0:
            raise ValueError(f"peak lr {self.peak}: must be > 0")
        if not 0 <= self.minimum <= self.peak:
            raise ValueError(f"min lr {self.minimum}: must lie in [0, peak lr {self.peak}]")
        if not 0 <= self.warmup_iters <= self.total_iters:
            raise ValueError(f"lr warm-up iters {self.warmup_iters}: must lie in [0, decay iters {self.total_iters}]")

    def __call__(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.peak * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.peak
        progress = min(1.0, (step - self.warmup_iters) / max(1, self.total_iters - self.warmup_iters))
        if self.decay_style == "linear":
            return self.minimum + (self.peak - self.minimum) * (1.0 - progress)
        return self.minimum + (self.peak - self.minimum) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A scheduler setting every group's lr to this schedule; the groups' initial lr must be the peak."""
        for group in optimizer.param_groups:
            if group.get("initial_lr", group["lr"]) != self.peak:
                raise ValueError(f"optimizer group lr {group['lr']} differs from the schedule's peak {self.peak}")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self(step) / self.peak)
