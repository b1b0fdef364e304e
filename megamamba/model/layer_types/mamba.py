"""A Mamba block: the pre-norm residual block around a Mamba-1 or Mamba-2 mixer (pattern symbol M)."""

from typing import Optional

from torch import nn

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.model.block import Block
from megamamba.model.mamba1 import Mamba1
from megamamba.model.mamba2 import Mamba2
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel


def make_mamba_mixer(
    config: MambaConfig,
    device=None,
    dtype=None,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
) -> nn.Module:
    """The Mamba mixer that config.ssm_cfg["layer"] names, built with its options (split across `tp`; on a
    slice of the sequence in the context-parallel group `cp`)."""
    options = config.mixer_options
    cls = Mamba1 if isinstance(options, Mamba1Options) else Mamba2
    return cls(config.d_model, options, device=device, dtype=dtype, tp=tp, cp=cp)


class MambaBlock(Block):
    """A block whose mixer is Mamba-1 or Mamba-2 (ssm_cfg.layer); pattern symbol M."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            config, lambda: make_mamba_mixer(config, device=device, dtype=dtype, tp=tp, cp=cp), tp, device, dtype
        )
