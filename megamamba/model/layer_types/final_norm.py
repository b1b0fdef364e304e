"""Layer n_layer + 1 of the list: the final norm (mamba_ssm's norm_f), from the stream to the head's input, and
what the framework knows of it (`FinalNormType`)."""

from typing import Optional

from megamamba.config import MambaConfig
from megamamba.model.block import NORM_EPS
from megamamba.model.layer_types.base import LayerType
from megamamba.model.layer_types.costs import STREAM, LayerWork, RankShape, norm, norm_weights
from megamamba.model.norm import LayerNorm, RMSNorm
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel


class _FinalNorm:
    """Mixed into a norm: the final norm (mamba_ssm's norm_f), the stream -> the hidden states the head reads,
    normalised in the norm's dtype."""

    def forward(self, x):  # Stream -> Stream
        return x.carrying(super().forward(x.hidden.to(dtype=self.weight.dtype)))


class FinalRMSNorm(_FinalNorm, RMSNorm):
    """Layer n_layer + 1 with rms_norm (key weight)."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(config.d_model, eps=NORM_EPS, device=device, dtype=dtype, tp=tp)


class FinalLayerNorm(_FinalNorm, LayerNorm):
    """Layer n_layer + 1 without rms_norm (keys weight, bias)."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(config.d_model, eps=NORM_EPS, device=device, dtype=dtype, tp=tp)


class FinalNormType(LayerType):
    """The final norm: no FLOPs counted; it keeps its input stream."""

    kind = "final_norm"

    def state_prefix(self, index: int) -> str:
        return "backbone.norm_f."

    def holds(self, key: str) -> bool:
        return key in ("weight", "bias")  # a LayerNorm's bias

    def layer_class(self, config: MambaConfig, tp: Optional[TensorParallel]) -> type:
        return FinalRMSNorm if config.rms_norm else FinalLayerNorm

    def flops_per_token(self, config: MambaConfig, seq_length: int) -> int:
        return 0

    def kept_bytes(self, shape: RankShape) -> int:
        return STREAM * shape.stream_width * shape.tokens

    def work(self, shape: RankShape) -> LayerWork:
        return LayerWork((norm(shape),), norm_weights(shape))


FINAL_NORM_TYPE = FinalNormType()
