"""Optimizer parameter groups: which parameters get weight decay.

No decay for parameters marked `_no_weight_decay` (the SSM's A_log, D, dt_bias, as mamba_ssm
marks them) and for every parameter with fewer than two dimensions (biases, norm weights).
Everything else decays, the embedding included (and the head tied to it), as Megatron-LM
does; mamba_ssm's own training recipe (flash-attn's param grouping) exempts nn.Embedding
instead. The rule reads only the parameter itself, so every pipeline stage or tensor shard
holding a parameter (a tied embedding on two stages, a slice of in_proj) puts it in the same
group.
"""

from torch import nn


def decays(param: nn.Parameter) -> bool:
    """Whether weight decay applies to `param`."""
    return param.dim() >= 2 and not getattr(param, "_no_weight_decay", False)


def param_groups(model: nn.Module, weight_decay: float) -> list:
    """[{"params": decayed, "weight_decay": weight_decay}, {"params": the rest, "weight_decay": 0.0}].

    Tied parameters appear once; frozen ones (requires_grad false) are left out.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
