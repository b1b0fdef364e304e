"""Interim data path: global batches of token windows that do not depend on the parallel layout.

The global batch of step s is `global_batch_size` windows of `seq_length + 1` tokens whose start
positions are drawn by a generator seeded with (seed, s). Rows are numbered 0..global_batch_size-1;
data-parallel rank r of d takes the contiguous rows [r*G/d, (r+1)*G/d) and cuts them into
micro-batches in order. So the samples of a step, and which micro-batch holds each, are fixed by
(seed, step) and the micro-batch size alone: any (dp, tp, pp) layout trains on the same data, and
a run restarted at step s reads exactly what an uninterrupted run would (nothing is replayed).
"""
import os
from typing import Iterator, Sequence

import torch

from megamamba.byte_tokenizer import ByteTokenizer
from megamamba.corpus import default_corpus

_STEP_STRIDE = 1_000_003  # seeds of different (seed, step) pairs never collide for step < stride


def read_documents(paths: Sequence[str]) -> list[str]:
    """Each file is one document (UTF-8); no paths means the built-in Python documentation corpus."""
    if not paths:
        return default_corpus()
    docs = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data {path!r}: no such file")
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    return docs


def tokenize(docs: Sequence[str], tokenizer: ByteTokenizer) -> torch.Tensor:
    """One int64 stream, every document followed by the end-of-document token."""
    ids = []
    for doc in docs:
        ids += tokenizer.encode(doc)
        ids.append(tokenizer.eod)
    return torch.tensor(ids, dtype=torch.int64)


def split_train_valid(tokens: torch.Tensor, valid_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream's last `valid_fraction` is held out for validation (never trained on)."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"validation fraction {valid_fraction}: must lie in (0, 1)")
    cut = int(tokens.numel() * (1 - valid_fraction))
    return tokens[:cut], tokens[cut:]


class GlobalBatches:
    """Step -> the global batch (inputs, labels), each (global_batch_size, seq_length) int64."""

    def __init__(self, tokens: torch.Tensor, seq_length: int, global_batch_size: int, seed: int):
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be a 1-D int64 stream, got {tokens.dim()}-D {tokens.dtype}")
        if tokens.numel() < seq_length + 2:
            raise ValueError(f"{tokens.numel()} tokens cannot hold one window of seq_length + 1 = {seq_length + 1}")
        self.tokens = tokens
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.seed = seed

    def _starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * _STEP_STRIDE + step)
        return torch.randint(0, self.tokens.numel() - self.seq_length - 1, (self.global_batch_size,), generator=g)

    def rows(self, step: int, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [first, stop) of the global batch of `step`."""
        starts = self._starts(step)[first:stop].tolist()
        windows = torch.stack([self.tokens[s : s + self.seq_length + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, 0, self.global_batch_size)

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list:
        """This data-parallel rank's slice of the step's global batch, as consecutive micro-batches."""
        per_rank = self.global_batch_size // dp_size
        if per_rank * dp_size != self.global_batch_size or per_rank % micro_batch_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into {dp_size} data-parallel ranks "
                f"of whole micro-batches of {micro_batch_size}"
            )
        first = dp_rank * per_rank
        return [self.rows(step, m, m + micro_batch_size) for m in range(first, first + per_rank, micro_batch_size)]

    def iterate(self, start_step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> Iterator:
        """Micro-batches of steps start_step, start_step + 1, ... in order, without end."""
        step = start_step
        while True:
            yield from self.micro_batches(step, dp_rank, dp_size, micro_batch_size)
            step += 1
