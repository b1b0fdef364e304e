"""The Mamba LM as a flat sequence of layers, each taking and returning one tensor.

mamba_ssm's blocks pass a pair (hidden, residual) and add them at the start of the next block.
Between layers we pass their sum instead, the residual stream s = hidden + residual: block i
computes hidden, residual = Block(s) and returns hidden + residual, the very sum the next block
would form, so the math (and every rounding) is the single-device model's, and a stage boundary
carries ONE float tensor (batch, seqlen, d_model) — float32 when residual_in_fp32, as
mamba_ssm keeps the residual. It always receives a gradient, as DeepSpeed requires.

Layer list: [embedding, block 0 .. block n-1, final norm, head]. The head reuses the
embedding's weight when tie_embeddings (a tied layer in the pipeline).
"""
import torch
import torch.nn.functional as F
from torch import nn

from megamamba.block import Block, make_norm
from megamamba.config import MambaConfig


class EmbeddingPipe(nn.Embedding):
    """Token ids (int64) -> the residual stream; weight (padded vocab, d_model) as mamba_ssm's embedding."""

    def __init__(self, config: MambaConfig):
        super().__init__(config.padded_vocab_size, config.d_model)
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

    def __init__(self, config: MambaConfig):
        super().__init__()
        self.norm = make_norm(config)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        return final_norm(self.norm, stream)


def final_norm(norm: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    return norm(stream.to(dtype=norm.weight.dtype))


class HeadPipe(nn.Linear):
    """Untied LM head: hidden -> logits over the padded vocabulary (mamba_ssm's lm_head)."""

    def __init__(self, config: MambaConfig):
        super().__init__(config.d_model, config.padded_vocab_size, bias=False)


def tied_head(embedding: nn.Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """Tied LM head: logits = hidden @ embedding.weight^T."""
    return F.linear(hidden, embedding.weight)


class LMLoss:
    """Mean next-token cross-entropy over the real vocabulary (the padded columns are dropped)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits[..., : self.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten())
