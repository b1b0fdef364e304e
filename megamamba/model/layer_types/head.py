"""The last layer of the list: the head, hidden states to logits over the padded vocabulary (with
tie_embeddings, the embedding's weight), and what the framework knows of it (`HeadType`)."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.layer_types.base import LayerType
from megamamba.model.layer_types.costs import LayerWork, RankShape, matmul, stream_in
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, VocabParallelHead, parallel_linear
from megamamba.parallel.context.context_parallel import ContextParallel


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: Optional[TensorParallel] = None) -> torch.Tensor:
    """hidden @ weight.T over the padded vocab; under TP `weight` is this rank's rows and the logits its
    block of columns (with sequence parallelism the hidden shards are gathered first)."""
    if tp is None:
        return F.linear(hidden, weight)
    return parallel_linear(hidden, weight, None, tp)


class Head(nn.Linear):
    """Layer n_layer + 2: hidden -> logits over the padded vocabulary (mamba_ssm's lm_head)."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)

    def forward(self, x):  # the stream -> logits
        return head_logits(x.hidden, self.weight)


class ParallelHead(VocabParallelHead):
    """Head with the vocabulary rows split across TP: this rank's block of the logits."""

    def __init__(self, config: MambaConfig, tp: TensorParallel, cp: Optional[ContextParallel] = None):
        super().__init__(config.d_model, config.padded_vocab_size, tp)

    def forward(self, x):  # the stream -> logits
        return head_logits(x.hidden, self.weight, self.tp)


def tied_head(embedding: nn.Module, x: Stream) -> torch.Tensor:
    """The head with tie_embeddings, as a pipeline's last stage runs it: the embedding layer's weight read as
    the head's."""
    return head_logits(x.hidden, embedding.weight, embedding.tp)


def tie(head: nn.Module, embedding: nn.Module) -> None:
    """Make `head` read `embedding`'s weight (tie_embeddings), as `tied_head` does."""
    head.weight = embedding.weight


class HeadType(LayerType):
    """The head: one matmul over the padded vocabulary (this rank's rows under TP, its input gathered under
    sequence parallelism); it keeps its input. `tied` when it reads the embedding's weight."""

    kind = "head"
    drawn_whole = True

    def state_prefix(self, index: int) -> str:
        return "lm_head."

    def layer_class(self, config: MambaConfig, tp: Optional[TensorParallel]) -> type:
        return Head if tp is None else ParallelHead

    def tied(self, config: MambaConfig) -> bool:
        return config.tie_embeddings

    def flops_per_token(self, config: MambaConfig, seq_length: int) -> int:
        return 2 * config.d_model * config.padded_vocab_size

    def kept_bytes(self, shape: RankShape) -> int:
        return shape.act * shape.model.d_model * shape.tokens

    def weight_elements(self, shape: RankShape) -> int:
        return shape.local_vocab * shape.model.d_model

    def work(self, shape: RankShape) -> LayerWork:
        logits = matmul(shape, shape.model.d_model, shape.local_vocab)
        return LayerWork((logits,), stream_in(shape, logits))


HEAD_TYPE = HeadType()
