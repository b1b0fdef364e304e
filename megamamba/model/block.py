"""The pre-norm residual block around a mixer, as mamba_ssm's `Block`.

A block takes and returns the residual stream (`megamamba.model.stream`); under sequence parallelism
the stream is this rank's sequence shard. Keys: `norm.weight` (+ `norm.bias` for LayerNorm),
`mixer.*`. More: docs/code.md.
"""
from typing import Optional

import torch
from torch import nn

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.model.mamba1 import Mamba1
from megamamba.model.mamba2 import Mamba2
from megamamba.model.norm import LayerNorm, RMSNorm
from megamamba.model.stream import pack, to_stream, unpack
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel

NORM_EPS = 1e-5  # mamba_ssm's norm_epsilon


def make_norm(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None) -> nn.Module:
    """RMSNorm, or LayerNorm (with bias) when rms_norm is false; under sequence parallelism
    (`tp.sequence_parallel`) it normalises this rank's sequence shard (see `megamamba.model.norm`)."""
    cls = RMSNorm if config.rms_norm else LayerNorm
    return cls(config.d_model, eps=NORM_EPS, device=device, dtype=dtype, tp=tp)


def make_mixer(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None,
               cp: Optional[ContextParallel] = None) -> nn.Module:
    """The mixer that config.ssm_cfg["layer"] names, built with its options (split across `tp`; on a
    slice of the sequence in the context-parallel group `cp`)."""
    options = config.mixer_options
    cls = Mamba1 if isinstance(options, Mamba1Options) else Mamba2
    return cls(config.d_model, options, device=device, dtype=dtype, tp=tp, cp=cp)


class Block(nn.Module):
    """One layer of the stream: s -> s + mixer(norm(s)) (the stream in float32 when residual_in_fp32)."""

    def __init__(self, config: MambaConfig, tp: Optional[TensorParallel] = None, cp: Optional[ContextParallel] = None,
                 device=None, dtype=None):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = make_norm(config, device=device, dtype=dtype, tp=tp)
        self.mixer = make_mixer(config, device=device, dtype=dtype, tp=tp, cp=cp)

    def _norm(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(stream) in the norm's dtype, the stream in its own dtype)."""
        stream = to_stream(stream, self.residual_in_fp32)
        if isinstance(self.norm, RMSNorm):
            return self.norm.stream_forward(stream), stream
        return self.norm(stream.to(dtype=self.norm.weight.dtype)), stream

    def forward(self, x, inference_state: Optional[tuple] = None):
        """stream [, seq_idx] -> the next stream [, seq_idx]; with `inference_state` (a prefill) the
        mixer's state after the last position is written into it."""
        stream, seq_idx = unpack(x)
        normed, stream = self._norm(stream)
        hidden = self.mixer(normed, seq_idx=seq_idx, inference_state=inference_state)
        return pack(hidden + stream, seq_idx)

    def step(self, stream: torch.Tensor, inference_state: tuple) -> torch.Tensor:
        """One token, (batch, d_model): as forward, through the mixer's recurrent step."""
        normed, stream = self._norm(stream)
        return self.mixer.step(normed, inference_state) + stream
