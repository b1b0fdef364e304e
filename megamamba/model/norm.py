"""RMSNorm, LayerNorm and the gated RMSNorm of Mamba-2, as mamba_ssm's modules (init: weight ones, bias zeros).

All but LayerNorm run through the kernel op `rmsnorm_gated` (Triton on CUDA): plain RMSNorm is
the op with no gate over the whole last dimension.

Under tensor parallelism the block norms (and the final norm) hold the whole weight on every
rank. Without sequence parallelism every rank normalises the same tokens, so the weights get the
same gradient everywhere and nothing is communicated. With sequence parallelism each rank
normalises its own sequence shard, so the weight enters through `copy_to_tp_region` and its
gradient is summed over the TP group inside backward (marked `grad_reduced`). Mamba-2's gated
norm is split by channel with the mixer (see `megamamba.model.mamba2`).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.kernels import add_rmsnorm, rmsnorm_gated
from megamamba.parallel import Shard, TensorParallel, copy_to_tp_region, mark, split


def _shared_over_sequence(module: nn.Module, tp: Optional[TensorParallel]) -> Optional[TensorParallel]:
    """The TP group whose sequence shards this norm sees, marking its parameters; None without SP."""
    tp = split(tp)
    if tp is None or not tp.sequence_parallel:
        return None
    for name, param in module.named_parameters(recurse=False):
        mark(param, Shard(name, None, grad_reduced=True))
    return tp


def _summed_over(param: Optional[torch.Tensor], tp: Optional[TensorParallel]) -> Optional[torch.Tensor]:
    return param if tp is None or param is None else copy_to_tp_region(param, tp)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (mamba_ssm's RMSNorm)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None, tp: Optional[TensorParallel] = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.sequence_tp = _shared_over_sequence(self, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_gated(x, _summed_over(self.weight, self.sequence_tp), eps=self.eps)

    def stream_forward(self, stream: torch.Tensor) -> torch.Tensor:
        """self(stream) in the weight's dtype, normalised from the stream's own precision (not first
        rounded to the weight's dtype), in one pass on the Triton kernels: a block's pre-norm."""
        normed, _ = add_rmsnorm(
            stream, None, _summed_over(self.weight, self.sequence_tp), eps=self.eps, residual_dtype=stream.dtype
        )
        return normed


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (keys weight, bias), its gradients summed over TP under sequence parallelism."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None, tp: Optional[TensorParallel] = None
    ):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
        self.sequence_tp = _shared_over_sequence(self, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x,
            self.normalized_shape,
            _summed_over(self.weight, self.sequence_tp),
            _summed_over(self.bias, self.sequence_tp),
            self.eps,
        )


class RMSNormGated(nn.Module):
    """RMSNorm per group of `group_size` channels, gated by silu(z) (mamba_ssm's layernorm_gated.RMSNorm).

    norm_before_gate=True: norm(x) * silu(z); False (Mamba-2's default): norm(x * silu(z)).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: Optional[int] = None,
        norm_before_gate: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return rmsnorm_gated(
            x, self.weight, z=z, eps=self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate
        )
