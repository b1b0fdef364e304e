"""An MLP block: the pre-norm residual block around an MLP of d_intermediate channels (pattern symbol -)."""

from typing import Optional

from megamamba.config import MambaConfig
from megamamba.model.block import Block
from megamamba.model.mlp import MLP
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel


class MLPBlock(Block):
    """A block whose mixer is an MLP of d_intermediate channels (mlp_activation); pattern symbol -."""

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
            lambda: MLP(config.d_model, config.mlp_width, config.mlp_activation, device=device, dtype=dtype, tp=tp),
            tp,
            device,
            dtype,
        )
