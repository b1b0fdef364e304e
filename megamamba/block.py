"""The pre-norm residual block around a mixer, as mamba_ssm's `Block`.

Written as Add -> Norm -> Mixer (the model is x + mixer(norm(x))) so one fused kernel does the
add and the norm; under sequence parallelism its hidden and residual are this rank's sequence
shard. Keys: `norm.weight` (+ `norm.bias` for LayerNorm), `mixer.*`. More: docs/code.md.
"""
from typing import Optional

import torch
from torch import nn

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.mamba1 import Mamba1
from megamamba.mamba2 import Mamba2
from megamamba.norm import LayerNorm, RMSNorm
from megamamba.parallel import TensorParallel
from megamamba.parallel.context_parallel import ContextParallel

NORM_EPS = 1e-5  # mamba_ssm's norm_epsilon


def make_norm(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None) -> nn.Module:
    """RMSNorm, or LayerNorm (with bias) when rms_norm is false; under sequence parallelism
    (`tp.sequence_parallel`) it normalises this rank's sequence shard (see `megamamba.norm`)."""
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
    """residual += hidden; hidden = mixer(norm(residual)). Residual in float32 (or wider) when residual_in_fp32."""

    def __init__(self, config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None,
                 cp: Optional[ContextParallel] = None):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = make_norm(config, device=device, dtype=dtype, tp=tp)
        self.mixer = make_mixer(config, device=device, dtype=dtype, tp=tp, cp=cp)

    def _add_norm(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        dtype = hidden_states.dtype if residual is None else torch.promote_types(hidden_states.dtype, residual.dtype)
        if self.residual_in_fp32:  # float32 at least: a float64 model keeps float64
            dtype = torch.promote_types(dtype, torch.float32)
        if isinstance(self.norm, RMSNorm):  # one fused pass on the Triton kernels
            return self.norm.add_forward(hidden_states, residual, dtype)
        residual = hidden_states if residual is None else hidden_states + residual
        return self.norm(residual.to(dtype=self.norm.weight.dtype)), residual.to(dtype)

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor] = None,
                seq_idx: Optional[torch.Tensor] = None, inference_state: Optional[tuple] = None):
        """(hidden_states, residual) of the previous block (residual None for the first) -> the pair for the next."""
        normed, residual = self._add_norm(hidden_states, residual)
        return self.mixer(normed, seq_idx=seq_idx, inference_state=inference_state), residual

    def step(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor], inference_state: tuple):
        """One token, (batch, d_model) tensors: as forward, through the mixer's recurrent step."""
        normed, residual = self._add_norm(hidden_states, residual)
        return self.mixer.step(normed, inference_state), residual
