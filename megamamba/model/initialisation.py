"""mamba_ssm's `_init_weights` pieces that a layer type applies after its constructor's draws: a redraw of a
parameter (under TP drawn on the full tensor, as one device would, then sliced) and zeroed Linear biases."""

from typing import Optional

import torch
from torch import nn

from megamamba.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel, local_shard

EMBEDDING_INIT_STD = 0.02


def redraw(param: nn.Parameter, full_shape: tuple, draw, tp: Optional[TensorParallel]) -> None:
    """Re-initialise `param` with `draw`, applied under TP to the full tensor, then sliced."""
    if tp is None:
        draw(param)
        return
    full = draw(torch.empty(full_shape, device=param.device, dtype=param.dtype))
    param.copy_(local_shard(full, param.tp_shard, tp.size, tp.rank))


@torch.no_grad()
def zero_biases(module: nn.Module) -> None:
    """Every Linear bias of `module` zeroed, except those marked `_no_reinit` (Mamba-1's dt_proj.bias)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            for bias in (m.bias, getattr(m, "bias_replicated", None)):
                if bias is not None and not getattr(bias, "_no_reinit", False):
                    nn.init.zeros_(bias)
