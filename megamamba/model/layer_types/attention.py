"""An attention block: the pre-norm residual block around causal self-attention (pattern symbol *)."""

from typing import Optional

from megamamba.config import MambaConfig
from megamamba.model.attention import Attention
from megamamba.model.block import Block
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel


class AttentionBlock(Block):
    """A block whose mixer is causal self-attention (attn_cfg); attn_layer_idx, or pattern symbol *."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            config,
            lambda: Attention(config.d_model, config.attention_options, device=device, dtype=dtype, tp=tp, cp=cp),
            tp,
            device,
            dtype,
        )
