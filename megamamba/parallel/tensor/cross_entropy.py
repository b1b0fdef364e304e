"""Cross-entropy over vocab-split logits that never gathers the full logits.

Each rank holds logits for its contiguous block of (padded) vocabulary rows. Two all-reduces
of per-token scalars suffice: the max (for a stable softmax), then the sum of exponentials
packed with the target's logit (held by exactly one rank). Padding columns (global index >=
`vocab_size`) are excluded as if they were -inf. Computed in float32 whatever the logits dtype.
"""

from __future__ import annotations

import torch

from megamamba.parallel.tensor.collectives import start_all_reduce
from megamamba.parallel.tensor.tensor_parallel import TensorParallel


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index):
        rows = logits.shape[-1]
        start = tp.rank * rows
        x = logits.float()
        if start + rows > vocab_size:
            x = x.clone()
            x[..., max(vocab_size - start, 0) :] = float("-inf")
        row_max = x.max(dim=-1).values.contiguous()
        start_all_reduce(row_max, tp, "max").wait()
        shifted = x - row_max.unsqueeze(-1)

        ignored = target == ignore_index
        mine = (target >= start) & (target < start + rows) & ~ignored
        local_target = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        start_all_reduce(sums, tp).wait()
        sum_exp, target_logit = sums[0], sums[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_target, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine, ignored = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: TensorParallel,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """torch's cross_entropy(full_logits[..., :vocab_size], target) from this rank's logits.

    logits: (..., rows_per_rank), this rank's block of the padded vocab (rank r holds rows
    [r * rows_per_rank, (r + 1) * rows_per_rank)); target: (...) global ids, replicated over TP,
    `ignore_index` where no loss is wanted. `vocab_size` (default: all rows) excludes the
    padding rows. reduction: "none" (per token, 0 where ignored), "sum", or "mean" over the
    tokens not ignored (NaN when every token is ignored, as torch gives).
    """
    vocab_size = logits.shape[-1] * tp.size if vocab_size is None else vocab_size
    if not 0 < vocab_size <= logits.shape[-1] * tp.size:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {logits.shape[-1]} rows x TP {tp.size}]")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)} minus the vocab dim"
        )
    loss = _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
