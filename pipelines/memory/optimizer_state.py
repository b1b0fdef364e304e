"""Bytes of optimizer state a rank holds, measured from the optimizer DeepSpeed built.

Counted: every tensor in the inner torch optimizer's state (Adam's exp_avg, exp_avg_sq), and the
parameters it steps that are not the model's own (the float32 master partitions ZeRO keeps).
With ZeRO-1 and float32 parameters that is (4 + 4 + 4) bytes x the stage's parameters / dp, plus
the padding ZeRO adds to make the flat buffers divisible by dp.
"""

import torch
from torch import nn


def optimizer_state_bytes(optimizer, module: nn.Module) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    own = {id(p) for p in module.parameters()}
    total = 0
    for group in inner.param_groups:
        total += sum(p.numel() * p.element_size() for p in group["params"] if id(p) not in own)
    for state in inner.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total
