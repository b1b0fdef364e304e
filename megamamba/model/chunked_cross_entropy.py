"""Mean cross-entropy over the first `vocab_size` columns of the logits, computed in row chunks.

`F.cross_entropy(logits[..., :vocab].float(), labels)` copies the whole logits to float32 twice
(the slice cast, then log_softmax's output kept for backward). Here only one chunk of rows is in
float32 at a time: the forward keeps each row's logsumexp (float32, one per row), the backward
rebuilds softmax - one_hot chunk by chunk into a gradient of the logits' dtype and shape (zero
on the padded columns and on ignored rows).
"""

import torch

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # float32 elements of one chunk (128 MiB): rows per chunk = this // vocab


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size):
        rows = logits.shape[0]
        valid = labels != IGNORE_INDEX
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        total = torch.zeros((), device=logits.device, dtype=torch.float32)
        step = _rows_per_chunk(vocab_size)
        for start in range(0, rows, step):
            chunk = logits[start : start + step, :vocab_size].float()
            lse[start : start + step] = torch.logsumexp(chunk, dim=-1)
            ok = valid[start : start + step]
            picked = chunk.gather(1, torch.where(ok, labels[start : start + step], 0)[:, None])[:, 0]
            total += torch.where(ok, lse[start : start + step] - picked, 0.0).sum()
        count = valid.sum()
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.vocab_size = vocab_size
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse, count = ctx.saved_tensors
        vocab_size = ctx.vocab_size
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad[:, vocab_size:] = 0
        scale = (grad_loss.float() / count).reshape(1, 1)
        step = _rows_per_chunk(vocab_size)
        for start in range(0, logits.shape[0], step):
            target = labels[start : start + step]
            ignored = (target == IGNORE_INDEX)[:, None]
            g = logits[start : start + step, :vocab_size] - lse[start : start + step, None]  # float32
            g.exp_().mul_(scale)
            g.scatter_add_(1, target.clamp(min=0)[:, None], (-scale).expand(len(target), 1))
            grad[start : start + step, :vocab_size] = g.masked_fill_(ignored, 0.0)
        return grad, None, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy of `labels` (..., -100 ignored) under `logits` (..., >= vocab_size columns),
    the columns past vocab_size excluded; as F.cross_entropy on the sliced float32 logits."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be the logits' {tuple(logits.shape[:-1])}")
    if not 0 < vocab_size <= logits.shape[-1]:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{logits.shape[-1]} (the logits' width)")
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), vocab_size)
