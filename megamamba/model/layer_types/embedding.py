"""Layer 0 of the list: the token embedding, whose output is the residual stream, and what the framework
knows of it (`EmbeddingType`)."""

from typing import Optional, cast

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.initialisation import EMBEDDING_INIT_STD, redraw
from megamamba.model.layer_types.base import LayerType
from megamamba.model.layer_types.costs import STREAM, Kernel, LayerWork, RankShape, onto_stream
from megamamba.model.stream import to_stream
from megamamba.parallel import TensorParallel, VocabParallelEmbedding
from megamamba.parallel.context.context_parallel import ContextParallel


class _EmbeddingOnTheStream:
    """Mixed into an embedding: the token ids -> the stream."""

    def forward(self, x):  # Stream -> Stream
        return x.carrying(to_stream(super().forward(x.hidden), self.residual_in_fp32))


class Embedding(_EmbeddingOnTheStream, nn.Embedding):
    """Layer 0; weight (padded vocab, d_model)."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(config.padded_vocab_size, config.d_model, device=device, dtype=dtype)
        self.residual_in_fp32, self.tp = config.residual_in_fp32, None


class ParallelEmbedding(_EmbeddingOnTheStream, VocabParallelEmbedding):
    """Embedding with the vocabulary rows split across TP (with sequence parallelism the stream is
    this rank's sequence shard)."""

    def __init__(self, config: MambaConfig, tp: TensorParallel, cp: Optional[ContextParallel] = None):
        super().__init__(config.padded_vocab_size, config.d_model, tp)
        self.residual_in_fp32 = config.residual_in_fp32


class EmbeddingType(LayerType):
    """The embedding: a lookup, no FLOPs; under TP each rank looks up its rows and the float32 partial sums are
    reduced onto the stream. It keeps nothing for the backward (its output is the next layer's input)."""

    kind = "embedding"
    drawn_whole = True

    def initialise(self, layer: nn.Module, config: MambaConfig, tp: Optional[TensorParallel]) -> None:
        """Drawn from N(0, 0.02^2)."""
        shape = (config.padded_vocab_size, config.d_model)
        redraw(cast(nn.Parameter, layer.weight), shape, lambda w: nn.init.normal_(w, std=EMBEDDING_INIT_STD), tp)

    def state_prefix(self, index: int) -> str:
        return "backbone.embedding."

    def layer_class(self, config: MambaConfig, tp: Optional[TensorParallel]) -> type:
        return Embedding if tp is None else ParallelEmbedding

    def flops_per_token(self, config: MambaConfig, seq_length: int) -> int:
        return 0

    def kept_bytes(self, shape: RankShape) -> int:
        return 0

    def work(self, shape: RankShape) -> LayerWork:
        t, d = shape.tokens, shape.model.d_model
        return LayerWork((Kernel("elementwise", 0, t * d * 2 * STREAM),), onto_stream(shape, t * d * STREAM))

    def example_input(self, config: MambaConfig, batch: int, seq_length: int, device) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (batch, seq_length), device=device)


EMBEDDING_TYPE = EmbeddingType()
