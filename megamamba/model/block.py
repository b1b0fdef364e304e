"""The pre-norm residual blocks around a mixer, as mamba_ssm's `Block`: Mamba, attention or MLP.

A block takes and returns the residual stream (`megamamba.model.stream`); under sequence parallelism
the stream is this rank's sequence shard. Keys: `norm.weight` (+ `norm.bias` for LayerNorm),
`mixer.*`, and with mamba_ssm's d_intermediate `norm2.*` and `mlp.fc1/fc2`. More: docs/code.md.
"""

from typing import Callable, Optional

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.mlp import MLP
from megamamba.model.norm import LayerNorm, RMSNorm
from megamamba.model.stream import Stream, to_stream
from megamamba.parallel import TensorParallel

NORM_EPS = 1e-5  # mamba_ssm's norm_epsilon


def make_norm(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None) -> nn.Module:
    """RMSNorm, or LayerNorm (with bias) when rms_norm is false; under sequence parallelism
    (`tp.sequence_parallel`) it normalises this rank's sequence shard (see `megamamba.model.norm`)."""
    cls = RMSNorm if config.rms_norm else LayerNorm
    return cls(config.d_model, eps=NORM_EPS, device=device, dtype=dtype, tp=tp)


class Block(nn.Module):
    """One layer of the stream: s -> s + mixer(norm(s)) (the stream in float32 when residual_in_fp32), then
    with mamba_ssm's d_intermediate s -> s + mlp(norm2(s))."""

    def __init__(
        self,
        config: MambaConfig,
        make_mixer: Callable[[], nn.Module],
        tp: Optional[TensorParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = make_norm(config, device=device, dtype=dtype, tp=tp)
        self.mixer = make_mixer()
        self.mlp = None
        if config.mlp_inside_blocks:
            self.norm2 = make_norm(config, device=device, dtype=dtype, tp=tp)
            self.mlp = MLP(config.d_model, config.mlp_width, config.mlp_activation, device=device, dtype=dtype, tp=tp)

    def output_projections(self) -> list:
        """The projections back onto the stream, which mamba_ssm initialises scaled by the depth."""
        return [m.output_projection for m in (self.mixer, self.mlp) if m is not None]

    def _norm(self, norm: nn.Module, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(stream) in the norm's dtype, the stream in its own dtype)."""
        stream = to_stream(stream, self.residual_in_fp32)
        if isinstance(norm, RMSNorm):
            return norm.stream_forward(stream), stream
        return norm(stream.to(dtype=norm.weight.dtype)), stream

    def _mlp(self, stream: torch.Tensor) -> torch.Tensor:
        if self.mlp is None:
            return stream
        normed, stream = self._norm(self.norm2, stream)
        return self.mlp(normed) + stream

    def forward(self, x: Stream, inference_state=None) -> Stream:
        """The stream -> the next stream; with `inference_state` (a prefill) the mixer's state after the last
        position is written into it."""
        normed, stream = self._norm(self.norm, x.hidden)
        stream = self.mixer(normed, seq_idx=x.seq_idx, inference_state=inference_state) + stream
        return x.carrying(self._mlp(stream))

    def allocate_inference_cache(self, batch_size: int, dtype=None):
        """The mixer's zeroed recurrent state (None for an MLP layer)."""
        return self.mixer.allocate_inference_cache(batch_size, dtype=dtype)

    def step(self, stream: torch.Tensor, inference_state) -> torch.Tensor:
        """One token, (batch, d_model): as forward, through the mixer's recurrent step."""
        normed, stream = self._norm(self.norm, stream)
        return self._mlp(self.mixer.step(normed, inference_state) + stream)
