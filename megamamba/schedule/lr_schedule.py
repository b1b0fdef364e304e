"""Learning-rate schedule: linear warm-up to the peak, then cosine, linear or constant decay.

Step s (0-based, the optimizer step about to run) gets
    warm-up (s < warmup_iters):  peak * (s + 1) / warmup_iters
    afterwards, p = (s - warmup_iters) / (total_iters - warmup_iters) clipped to [0, 1]:
        cosine:   minimum + (peak - minimum) * (1 + cos(pi * p)) / 2
        linear:   minimum + (peak - minimum) * (1 - p)
        constant: peak
The schedule is a pure function of the step, so a run restarted at step s continues it exactly.
`DeepSpeedSchedule` is DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, step for step.
"""

import math
from dataclasses import dataclass

import torch

DECAY_STYLES = ("cosine", "linear", "constant")
WARMUP_TYPES = ("log", "linear")


class _Schedule:
    peak: float

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A scheduler setting every group's lr to this schedule; the groups' initial lr must be the peak."""
        for group in optimizer.param_groups:
            if group.get("initial_lr", group["lr"]) != self.peak:
                raise ValueError(f"optimizer group lr {group['lr']} differs from the schedule's peak {self.peak}")
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self(step) / self.peak)


@dataclass(frozen=True)
class LRSchedule(_Schedule):
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


@dataclass(frozen=True)
class DeepSpeedSchedule(_Schedule):
    """DeepSpeed 0.19's WarmupLR (decay "constant"), WarmupDecayLR ("linear"), WarmupCosineLR ("cosine").

    DeepSpeed steps its scheduler after each optimizer step, from iteration -1, so optimizer step s
    runs at iteration t = s - 1 (W = warmup_steps, already max(2, warmup_num_steps); T = total_steps):
        t < 0:  first (warmup_min_lr; 0.0 for WarmupCosineLR)
        t < W:  start + (peak - start) * g, g = log(t + 1) / log(W) ("log") or t / W ("linear")
        then    constant: peak
                linear:   start + (peak - start) * max(0, (T - t) / max(1, T - W))   (decays to start)
                cosine:   minimum + (peak - minimum) * (1 + cos(pi * min(1, (t - W + 1) / max(1, T - W)))) / 2
    """

    peak: float
    start: float
    warmup_steps: int
    warmup_type: str
    decay_style: str
    total_steps: int
    minimum: float
    first: float

    def __post_init__(self):
        if self.warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type {self.warmup_type!r}: choose one of {WARMUP_TYPES}")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.decay_style!r}: choose one of {DECAY_STYLES}")
        if not self.peak > 0:
            raise ValueError(f"peak lr {self.peak}: must be > 0")
        if self.warmup_steps < 2:
            raise ValueError(f"warm-up steps {self.warmup_steps}: DeepSpeed warms up over at least 2")

    @property
    def warmup_iters(self) -> int:  # LRSchedule's names, for code that describes either schedule
        return self.warmup_steps

    @property
    def total_iters(self) -> int:
        return self.total_steps

    def __call__(self, step: int) -> float:
        t = step - 1
        if t < 0:
            return self.first
        if t < self.warmup_steps:
            if self.warmup_type == "log":
                gamma = 1.0 / math.log(self.warmup_steps) * math.log(t + 1)
            else:
                gamma = t / self.warmup_steps
            return self.start + (self.peak - self.start) * gamma
        span = max(1, self.total_steps - self.warmup_steps)
        if self.decay_style == "constant":
            return self.peak
        if self.decay_style == "linear":
            return self.start + (self.peak - self.start) * max(0.0, (self.total_steps - t) / span)
        progress = min(1.0, (t - self.warmup_steps + 1) / span)
        return self.minimum + (self.peak - self.minimum) * (1 + math.cos(math.pi * progress)) / 2
