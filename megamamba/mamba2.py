"""The Mamba-2 mixer: state-space duality (SSD) with scalar-times-identity A per head (Dao & Gu, 2024).

Parameter names, shapes and initialisation are mamba_ssm's `Mamba2` (mamba2.py), so its
state dicts load unchanged (conv_dim = d_inner + 2*ngroups*d_state):

    in_proj   (2*d_inner + 2*ngroups*d_state + nheads, d_model) -> z, x, B, C, dt in that order
    conv1d    weight (conv_dim, 1, d_conv), bias (conv_dim,)       over x, B, C together
    dt_bias   (nheads,)    softplus^-1(dt) at init
    A_log     (nheads,)    A = -exp(A_log)
    D         (nheads,), or (d_inner,) with D_has_hdim
    norm      weight (d_inner,)   gated RMSNorm per group of d_inner/ngroups channels (with rmsnorm)
    out_proj  (d_model, d_inner)

Split sizes come from this module's own attributes (d_inner, nheads, ngroups, d_state), so a
tensor-parallel version only has to build it with its local sizes.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.config import Mamba2Options
from megamamba.kernels import causal_conv1d, causal_conv1d_update, selective_state_update, ssd_chunk_scan
from megamamba.mamba1 import fp32_or_wider, sample_dt_bias
from megamamba.norm import RMSNormGated


class Mamba2(nn.Module):
    """Mamba-2 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""

    def __init__(self, d_model: int, options: Mamba2Options = Mamba2Options(), device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = options.d_state
        self.d_conv = options.d_conv
        self.d_inner = int(options.expand * d_model)
        self.headdim = options.headdim
        self.nheads = self.d_inner // self.headdim
        self.ngroups = options.ngroups
        self.D_has_hdim = options.D_has_hdim
        self.rmsnorm = options.rmsnorm
        self.dt_limit = tuple(options.dt_limit)
        self.chunk_size = options.chunk_size

        d_in_proj = 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=options.bias, **factory)
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=self.d_conv, groups=conv_dim,
                                padding=self.d_conv - 1, bias=options.conv_bias, **factory)
        if options.conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -options.conv_init, options.conv_init)

        self.dt_bias = nn.Parameter(sample_dt_bias(self.nheads, options.dt_min, options.dt_max,
                                                   options.dt_init_floor, **factory))
        self.dt_bias._no_weight_decay = True
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*options.A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner if self.D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True

        if self.rmsnorm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, group_size=self.d_inner // self.ngroups,
                                     norm_before_gate=options.norm_before_gate, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=options.bias, **factory)

    # ---- splits of the fused projection --------------------------------------------------
    def split_in_proj(self, zxbcdt: torch.Tensor):
        """in_proj output -> z (..., d_inner), xBC (..., d_inner + 2*ngroups*d_state), dt (..., nheads)."""
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        return torch.split(zxbcdt, [self.d_inner, conv_dim, self.nheads], dim=-1)

    def split_xBC(self, xBC: torch.Tensor):
        """conv output (..., conv_dim) -> x (..., nheads, headdim), B, C (..., ngroups, d_state)."""
        gn = self.ngroups * self.d_state
        x, B, C = torch.split(xBC, [self.d_inner, gn, gn], dim=-1)
        lead = xBC.shape[:-1]
        return (x.reshape(*lead, self.nheads, self.headdim), B.reshape(*lead, self.ngroups, self.d_state),
                C.reshape(*lead, self.ngroups, self.d_state))

    def A(self) -> torch.Tensor:
        """Per-head decay rate, (nheads,), float32 (or wider)."""
        return -torch.exp(fp32_or_wider(self.A_log))

    def D_per_head(self) -> torch.Tensor:
        """D as the scan takes it: (nheads,), or (nheads, headdim) with D_has_hdim."""
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def gate_and_project(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z (..., d_inner) -> out_proj(norm(y, z)); without rmsnorm the gate was applied in the scan."""
        if self.rmsnorm:
            y = self.norm(y, z)
        return self.out_proj(y)

    # ---- parallel form -------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                inference_state: Optional[tuple] = None) -> torch.Tensor:
        """hidden_states (batch, seqlen, d_model); seq_idx (batch, seqlen) int32 document ids reset
        the conv and SSM state at document boundaries. With `inference_state` (conv_state, ssm_state)
        from `allocate_inference_cache`, the states after the last position are written into it."""
        batch, seqlen, _ = hidden_states.shape
        z, xBC, dt = self.split_in_proj(self.in_proj(hidden_states))
        xBC = xBC.transpose(1, 2)  # (batch, conv_dim, seqlen)
        if inference_state is not None:
            inference_state[0].copy_(F.pad(xBC, (self.d_conv - seqlen, 0)))
        xBC = causal_conv1d(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, seq_idx=seq_idx,
                            activation="silu").transpose(1, 2)
        x, B, C = self.split_xBC(xBC)
        y = ssd_chunk_scan(x, dt, self.A(), B, C, self.chunk_size, D=self.D_per_head(),
                           z=None if self.rmsnorm else z.reshape_as(x), dt_bias=self.dt_bias, seq_idx=seq_idx,
                           dt_softplus=True, dt_limit=self.dt_limit,
                           return_final_states=inference_state is not None)
        if inference_state is not None:
            y, final_state = y
            inference_state[1].copy_(final_state)
        return self.gate_and_project(y.reshape(batch, seqlen, self.d_inner), z)

    # ---- recurrent form (generation) -------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, dtype=None) -> tuple:
        """Zero (conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim, d_state))."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.in_proj.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device,
                                 dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def step(self, hidden_states: torch.Tensor, inference_state: tuple) -> torch.Tensor:
        """One token: hidden_states (batch, d_model) -> (batch, d_model); the states advance in place."""
        conv_state, ssm_state = inference_state
        z, xBC, dt = self.split_in_proj(self.in_proj(hidden_states))
        xBC = causal_conv1d_update(xBC, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                   activation="silu")
        x, B, C = self.split_xBC(xBC)
        # dt as the scan computes it (bias, softplus, dt_limit), then broadcast over each head's channels.
        dt = F.softplus(fp32_or_wider(dt) + fp32_or_wider(self.dt_bias)).clamp(*self.dt_limit)
        per_channel = (self.nheads, self.headdim)
        y = selective_state_update(
            ssm_state, x, dt[..., None].expand(-1, *per_channel),
            self.A()[:, None, None].expand(*per_channel, self.d_state), B, C,
            D=fp32_or_wider(self.D_per_head()).reshape(self.nheads, -1).expand(per_channel),
            z=None if self.rmsnorm else z.reshape_as(x),
        )
        return self.gate_and_project(y.reshape(-1, self.d_inner), z)
