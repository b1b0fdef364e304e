"""The depthwise causal convolution's weights, split by channel across tensor-parallel ranks.

A depthwise conv needs no communication: each channel is convolved on its own, so a rank
convolves exactly the channels its in_proj slice produced. Mamba-2 convolves [x, B, C]
together: x is split by channel; B and C are split with their groups, or held whole on every
rank when the groups are replicated (ngroups < TP), their gradients then summed over TP.
Full shapes are nn.Conv1d's, (channels, 1, width) and (channels,), under the names `weight`
and `bias`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megamamba.parallel.tensor.components import component_parameters, in_component_order
from megamamba.parallel.tensor.sharding import Component
from megamamba.parallel.tensor.tensor_parallel import TensorParallel


class ParallelDepthwiseConv1d(nn.Module):
    """This rank's channels of a depthwise Conv1d over `components` (full channel blocks, in order).

    Holds parameters only; `weight_and_bias()` gives them as the conv kernel takes them. The
    values are loaded from the full weights (`megamamba.parallel.tensor.from_full.sharded`).
    """

    def __init__(self, components: Sequence[Component], width: int, tp: TensorParallel, *, bias: bool = True):
        super().__init__()
        self.components, self.width, self.tp = tuple(components), width, tp
        channels = sum(c.size for c in self.components)
        self.weight, self.weight_replicated = component_parameters(
            (channels, 1, width), 0, self.components, tp, "weight"
        )
        self.bias = self.bias_replicated = None
        if bias:
            self.bias, self.bias_replicated = component_parameters((channels,), 0, self.components, tp, "bias")

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight (local channels, width), bias (local channels,) or None), in component order."""
        weight = in_component_order(self.weight, self.weight_replicated, self.components, self.tp).squeeze(1)
        if self.bias is None:
            return weight, None
        return weight, in_component_order(self.bias, self.bias_replicated, self.components, self.tp)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{c.name}={c.size}{'' if c.sharded else ' (replicated)'}" for c in self.components)
        return f"channels=[{parts}], width={self.width}, tp={self.tp.size}"
