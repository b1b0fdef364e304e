"""The training loss on the last layer's logits, as the plain engine and the pipeline's last stage take it."""

from typing import Optional

import torch

from megamamba.model.lm import lm_loss
from megamamba.parallel import TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel


class LMLoss:
    """Mean next-token cross-entropy over the real vocabulary (padded columns excluded; vocab-parallel under TP).

    Under CP the value is the mean over the whole sequences, and its gradient is C times this rank's
    share: DeepSpeed averages gradients over its data axis of dp x C ranks, and the average of C x
    the shares is the sum of the shares over the CP group (the whole sequences' gradient) averaged
    over dp, as without CP.
    """

    def __init__(self, vocab_size: int, tp: Optional[TensorParallel] = None, cp: Optional[ContextParallel] = None):
        self.vocab_size = vocab_size
        self.tp = tp
        self.cp = split(cp)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, labels, self.vocab_size, self.tp, self.cp)
        return loss if self.cp is None else _ScaleGradient.apply(loss, float(self.cp.size))


class _ScaleGradient(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None
