"""The Mamba LM as a flat sequence of layers, each taking and returning one tensor.

mamba_ssm's blocks pass a pair (hidden, residual) and add them at the start of the next block.
Between layers we pass their sum instead, the residual stream s = hidden + residual: block i
computes hidden, residual = Block(s) and returns hidden + residual, the very sum the next block
would form, so the math (and every rounding) is the single-device model's, and a stage boundary
carries ONE float tensor (batch, seqlen, d_model) — float32 when residual_in_fp32, as
mamba_ssm keeps the residual. It always receives a gradient, as DeepSpeed requires.

Layer list: [embedding, block 0 .. block n-1, final norm, head]. The head reuses the
embedding's weight when tie_embeddings (a tied layer in the pipeline).

Tensor parallelism (`tp`, a `megamamba.parallel.TensorParallel` of size > 1, else None): the
embedding and head split the vocabulary rows, the blocks their mixers (`megamamba.lm` and
`megamamba.block` build them); the logits stay split and the loss is the vocab-parallel
cross-entropy. The stream is the same on every TP rank, or with sequence parallelism this
rank's sequence shard (batch, seqlen / TP, d_model).
"""
from typing import Optional

import torch
from torch import nn

from megamamba.block import Block, make_norm
from megamamba.config import MambaConfig
from megamamba.lm import head_logits, lm_loss
from megamamba.parallel import TensorParallel, VocabParallelEmbedding, VocabParallelHead


class EmbeddingPipe(nn.Embedding):
    """Token ids (int64) -> the residual stream; weight (padded vocab, d_model) as mamba_ssm's embedding."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None):
        super().__init__(config.padded_vocab_size, config.d_model)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return as_stream(super().forward(input_ids), self.residual_in_fp32)


class ParallelEmbeddingPipe(VocabParallelEmbedding):
    """EmbeddingPipe with the vocabulary rows split across TP (same parameter name, `weight`)."""

    def __init__(self, config: MambaConfig, tp: TensorParallel):
        super().__init__(config.padded_vocab_size, config.d_model, tp)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return as_stream(super().forward(input_ids), self.residual_in_fp32)


def as_stream(embedded: torch.Tensor, residual_in_fp32: bool) -> torch.Tensor:
    """The stream entering block 0: the embedding, in float32 when the residual is kept in float32."""
    return embedded.float() if residual_in_fp32 else embedded


class BlockPipe(Block):
    """One Mamba block on the residual stream: s -> s + mixer(norm(s))."""

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        return advance(super().forward, stream)


def advance(block_forward, stream: torch.Tensor) -> torch.Tensor:
    """Run a block's (hidden, residual) forward on the stream and return the next stream."""
    hidden, residual = block_forward(stream)
    return hidden + residual


class FinalNormPipe(nn.Module):
    """The stream -> final-normed hidden states (mamba_ssm's norm_f)."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.norm = make_norm(config, tp=tp)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        return final_norm(self.norm, stream)


def final_norm(norm: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    return norm(stream.to(dtype=norm.weight.dtype))


class HeadPipe(nn.Linear):
    """Untied LM head: hidden -> logits over the padded vocabulary (mamba_ssm's lm_head)."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None):
        super().__init__(config.d_model, config.padded_vocab_size, bias=False)


class ParallelHeadPipe(VocabParallelHead):
    """HeadPipe with the vocabulary rows split across TP: this rank's block of the logits."""

    def __init__(self, config: MambaConfig, tp: TensorParallel):
        super().__init__(config.d_model, config.padded_vocab_size, tp)


class TiedHead:
    """Tied LM head on the embedding module: logits = hidden @ embedding.weight^T (vocab-split under TP)."""

    def __init__(self, tp: Optional[TensorParallel] = None):
        self.tp = tp

    def __call__(self, embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(hidden, embedding.weight, self.tp)


class LMLoss:
    """Mean next-token cross-entropy over the real vocabulary (padded columns excluded; vocab-parallel under TP)."""

    def __init__(self, vocab_size: int, tp: Optional[TensorParallel] = None):
        self.vocab_size = vocab_size
        self.tp = tp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, labels, self.vocab_size, self.tp)
