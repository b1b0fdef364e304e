"""Layer 0 of the list: the token embedding, whose output is the residual stream."""

from typing import Optional

from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.stream import pack, to_stream, unpack
from megamamba.parallel import TensorParallel, VocabParallelEmbedding
from megamamba.parallel.context.context_parallel import ContextParallel


class _EmbeddingOnTheStream:
    """Mixed into an embedding: token ids [, seq_idx] -> the stream [, seq_idx]."""

    def forward(self, x):
        ids, seq_idx = unpack(x)
        return pack(to_stream(super().forward(ids), self.residual_in_fp32), seq_idx)


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
