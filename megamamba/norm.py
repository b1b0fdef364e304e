"""RMSNorm and the gated RMSNorm of Mamba-2, as mamba_ssm's modules (weight only, init ones).

Both run through the kernel op `rmsnorm_gated` (Triton on CUDA): plain RMSNorm is the op
with no gate over the whole last dimension.
"""
from typing import Optional

import torch
from torch import nn

from megamamba.kernels import rmsnorm_gated


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (mamba_ssm's RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_gated(x, self.weight, eps=self.eps)


class RMSNormGated(nn.Module):
    """RMSNorm per group of `group_size` channels, gated by silu(z) (mamba_ssm's layernorm_gated.RMSNorm).

    norm_before_gate=True: norm(x) * silu(z); False (Mamba-2's default): norm(x * silu(z)).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return rmsnorm_gated(x, self.weight, z=z, eps=self.eps, group_size=self.group_size,
                             norm_before_gate=self.norm_before_gate)
