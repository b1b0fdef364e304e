"""The MLP of hybrid models: mamba_ssm's GatedMLP (fc1 -> [y, gate], y * silu(gate) -> fc2) or Nemotron-H's
squared-ReLU MLP (fc1 -> relu(.)^2 -> fc2), without biases as both.

Keys `fc1.weight`, `fc2.weight` (mamba_ssm's). With `tp` it is built whole and `_shard` keeps this rank's
hidden channels: fc1 column-parallel (each of y and gate split on its own), fc2 row-parallel.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.parallel import ColumnParallelLinear, Component, RowParallelLinear, TensorParallel, split
from megamamba.parallel.tensor.from_full import sharded


class MLP(nn.Module):
    """(batch, seqlen, d_model) -> (batch, seqlen, d_model) through `hidden` channels."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "gated_silu",
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
    ):
        super().__init__()
        self.gated = activation == "gated_silu"
        self.d_model, self.hidden = d_model, hidden
        self.fc1 = nn.Linear(d_model, 2 * hidden if self.gated else hidden, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d_model, bias=False, device=device, dtype=dtype)
        tp = split(tp)
        if tp is not None:
            self._shard(tp)

    def _shard(self, tp: TensorParallel) -> None:
        parts = [Component("y", self.hidden), Component("gate", self.hidden)] if self.gated else None
        self.fc1 = sharded(
            self.fc1,
            lambda: ColumnParallelLinear(self.d_model, self.fc1.out_features, tp, bias=False, components=parts),
            tp,
        )
        self.fc2 = sharded(self.fc2, lambda: RowParallelLinear(self.hidden, self.d_model, tp, bias=False), tp)

    @property
    def output_projection(self) -> nn.Module:
        """The projection back onto the residual stream (initialised scaled by depth, as mamba_ssm)."""
        return self.fc2

    def forward(
        self,
        hidden_states: torch.Tensor,
        seq_idx: Optional[torch.Tensor] = None,
        inference_state: Optional[tuple] = None,
    ) -> torch.Tensor:
        """Token by token: `seq_idx` and `inference_state` are taken as every mixer takes them, and unused."""
        y = self.fc1(hidden_states)
        if self.gated:
            y, gate = y.chunk(2, dim=-1)
            y = y * F.silu(gate)
        else:
            y = F.relu(y).square()
        return self.fc2(y)

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> None:
        """No state: an MLP sees one token at a time."""
        return None

    def step(self, hidden_states: torch.Tensor, inference_state: None) -> torch.Tensor:
        return self(hidden_states)
