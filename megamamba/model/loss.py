"""The language-modelling loss on the head's logits, as the model and a pipeline's last stage compute it."""

from typing import Optional

import torch

from megamamba.model.chunked_cross_entropy import chunked_cross_entropy
from megamamba.parallel import TensorParallel, split, vocab_parallel_cross_entropy
from megamamba.parallel.context.context_parallel import ContextParallel, mean_over_context


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not -100, on the real vocabulary (padded
    columns excluded). Under TP `logits` is this rank's vocab block and the full logits are never
    gathered (`vocab_parallel_cross_entropy`); every rank gets the loss. On one device the float32
    logits are never materialized whole (`chunked_cross_entropy`). Under CP `logits` and `labels`
    are this rank's slice and the mean is over the whole sequences (`mean_over_context`)."""
    tp = split(tp)
    if tp is None:
        loss = chunked_cross_entropy(logits, labels, vocab_size)
    else:
        loss = vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=vocab_size)
    cp = split(cp)
    return loss if cp is None else mean_over_context(loss, labels, cp)


def training_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
    aux_loss: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`lm_loss`, whose gradient under CP is C times this rank's share: a data-parallel engine averages gradients
    over every rank of its data axis (DeepSpeed's: dp x C ranks), and the average of C x the shares is the sum of
    the shares over the CP group (the whole sequences' gradient) averaged over dp, as without CP. With `aux_loss`
    (the stream's router losses: under CP this rank's share, scaled alike) the gradient is that of their sum, the
    value the language-modelling loss's alone, so that the logged loss is comparable with and without experts."""
    loss = lm_loss(logits, labels, vocab_size, tp, cp)
    cp = split(cp)
    if cp is not None:
        loss = _ScaleGradient.apply(loss, float(cp.size))
        aux_loss = None if aux_loss is None else _ScaleGradient.apply(aux_loss, float(cp.size))
    return loss if aux_loss is None else _AddInBackward.apply(loss, aux_loss)


class _AddInBackward(torch.autograd.Function):
    """`loss` forward; backward the gradient of loss + aux_loss (the same gradient to both)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux_loss.dtype
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.to(ctx.aux_dtype)


class _ScaleGradient(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None
