"""The Mamba LM as a flat sequence of layers, each taking and returning one tensor.

mamba_ssm's blocks pass a pair (hidden, residual) and add them at the start of the next block.
Between layers we pass their sum instead, the residual stream s = hidden + residual: block i
computes hidden, residual = Block(s) and returns hidden + residual, the very sum the next block
would form, so the math (and every rounding) is the single-device model's, and a stage boundary
carries ONE float tensor (batch, seqlen, d_model) — float32 when residual_in_fp32, as
mamba_ssm keeps the residual. It always receives a gradient, as DeepSpeed requires.

Packed documents: the first layer takes token ids, or the pair (ids, seq_idx) with seq_idx the
(batch, seqlen) document ids; every layer up to the final norm then passes (stream, seq_idx),
so each block on each stage resets its conv and SSM state where the id changes. seq_idx is an
integer tensor: DeepSpeed sends it along and expects no gradient for it (it sends gradients of
float tensors only), and with TP it is the second tensor of the pair, which `pipe_partitioned`
leaves whole. It reaches the kernels as int32.

Layer list: [embedding, block 0 .. block n-1, final norm, head]. The head reuses the
embedding's weight when tie_embeddings (a tied layer in the pipeline).

Tensor parallelism (`tp`, a `megamamba.parallel.TensorParallel` of size > 1, else None): the
embedding and head split the vocabulary rows, the blocks their mixers (`megamamba.lm` and
`megamamba.block` build them); the logits stay split and the loss is the vocab-parallel
cross-entropy. The stream is the same on every TP rank, or with sequence parallelism this
rank's sequence shard (batch, seqlen / TP, d_model).

Context parallelism (`cp`, a `megamamba.parallel.context_parallel.ContextParallel` of size C > 1,
else None): every layer holds this rank's slice of each sequence (batch, seqlen / C, ...), the
blocks pass states across the CP group, and the loss is the mean over the whole sequences.
"""
from typing import Optional

import torch
from torch import nn

from megamamba.block import Block, make_norm
from megamamba.config import MambaConfig
from megamamba.lm import head_logits, lm_loss
from megamamba.parallel import TensorParallel, VocabParallelEmbedding, VocabParallelHead
from megamamba.parallel.context_parallel import ContextParallel


def unpack(x) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A layer input -> (tensor, seq_idx as int32 or None): a tensor alone or the pair (tensor, seq_idx)."""
    if isinstance(x, torch.Tensor):
        return x, None
    tensor, seq_idx = x
    return tensor, seq_idx.to(torch.int32)


def pack(tensor: torch.Tensor, seq_idx: Optional[torch.Tensor]):
    """The layer output for the next layer: the tensor, with seq_idx beside it when there is one."""
    return tensor if seq_idx is None else (tensor, seq_idx)


class EmbeddingPipe(nn.Embedding):
    """Token ids (int64) [, seq_idx] -> the residual stream [, seq_idx]; weight (padded vocab, d_model)."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None):
        super().__init__(config.padded_vocab_size, config.d_model)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, inputs):
        return embed(super().forward, inputs, self.residual_in_fp32)


class ParallelEmbeddingPipe(VocabParallelEmbedding):
    """EmbeddingPipe with the vocabulary rows split across TP (same parameter name, `weight`)."""

    def __init__(self, config: MambaConfig, tp: TensorParallel):
        super().__init__(config.padded_vocab_size, config.d_model, tp)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, inputs):
        return embed(super().forward, inputs, self.residual_in_fp32)


def embed(embedding_forward, inputs, residual_in_fp32: bool):
    """ids [, seq_idx] -> the stream entering block 0 [, seq_idx]."""
    input_ids, seq_idx = unpack(inputs)
    return pack(as_stream(embedding_forward(input_ids), residual_in_fp32), seq_idx)


def as_stream(embedded: torch.Tensor, residual_in_fp32: bool) -> torch.Tensor:
    """The stream entering block 0: the embedding, in float32 when the residual is kept in float32."""
    return embedded.float() if residual_in_fp32 else embedded


class BlockPipe(Block):
    """One Mamba block on the residual stream: s -> s + mixer(norm(s)) [, seq_idx passed on]."""

    def forward(self, x):
        return block_step(super().forward, x)


def block_step(block_forward, x):
    """stream [, seq_idx] -> the next stream [, seq_idx]."""
    stream, seq_idx = unpack(x)
    return pack(advance(block_forward, stream, seq_idx), seq_idx)


def advance(block_forward, stream: torch.Tensor, seq_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run a block's (hidden, residual) forward on the stream and return the next stream."""
    hidden, residual = block_forward(stream, seq_idx=seq_idx)
    return hidden + residual


class FinalNormPipe(nn.Module):
    """The stream [, seq_idx] -> final-normed hidden states (mamba_ssm's norm_f); seq_idx ends here."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.norm = make_norm(config, tp=tp)

    def forward(self, x) -> torch.Tensor:
        return final_norm(self.norm, unpack(x)[0])


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
    """Mean next-token cross-entropy over the real vocabulary (padded columns excluded; vocab-parallel under TP).

    Under CP the value is the mean over the whole sequences, and its gradient is C times this rank's
    share: DeepSpeed averages gradients over its data axis of dp x C ranks, and the average of C x
    the shares is the sum of the shares over the CP group (the whole sequences' gradient) averaged
    over dp, as without CP.
    """

    def __init__(self, vocab_size: int, tp: Optional[TensorParallel] = None, cp: Optional[ContextParallel] = None):
        self.vocab_size = vocab_size
        self.tp = tp
        self.cp = cp if cp is not None and cp.size > 1 else None

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
