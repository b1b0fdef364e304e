"""The Mamba-1 mixer: selective SSM with a short causal convolution (Gu & Dao, 2023).

Parameter names, shapes and initialisation are mamba_ssm's `Mamba` (mamba_simple.py), so its
state dicts load unchanged. With `tp` the mixer is built whole and `_shard` keeps this rank's
channels; with `cp` its conv and scan come from a `ContextSlice`. Parameter table, sharding and
communication: docs/code.md ("The model in code").
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba import kernels
from megamamba.config import Mamba1Options
from megamamba.kernels import causal_conv1d_update, selective_state_update
from megamamba.parallel import (
    ColumnParallelLinear,
    Component,
    RowParallelLinear,
    TensorParallel,
    copy_to_tp_region,
    split,
)
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.context.context_slice import ContextSlice
from megamamba.parallel.tensor.conv import ParallelDepthwiseConv1d
from megamamba.parallel.tensor.from_full import shard_parameter, sharded, split_rows
from megamamba.parallel.tensor.model_layout import check_mixer_layout


def fp32_or_wider(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or kept as is when already wider (float64 checks stay float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sample_dt_bias(n: int, dt_min: float, dt_max: float, dt_init_floor: float, device=None, dtype=None) -> torch.Tensor:
    """softplus^-1 of dt drawn log-uniformly in [dt_min, dt_max] and floored at dt_init_floor."""
    log_dt = torch.rand(n, device=device, dtype=dtype) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
    dt = torch.exp(log_dt).clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


class Mamba1(nn.Module):
    """Mamba-1 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""

    def __init__(
        self,
        d_model: int,
        options: Mamba1Options = Mamba1Options(),
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        if tp is not None:
            check_mixer_layout(d_model, options, tp.size)
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = options.d_state
        self.d_conv = options.d_conv
        self.d_inner = int(options.expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if options.dt_rank == "auto" else options.dt_rank

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=options.bias, **factory)
        self.conv1d = nn.Conv1d(
            self.d_inner,
            self.d_inner,
            kernel_size=self.d_conv,
            groups=self.d_inner,
            padding=self.d_conv - 1,
            bias=options.conv_bias,
            **factory,
        )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=options.bias, **factory)

        # dt projection: weights scaled to preserve variance, bias so softplus(bias) = dt at init.
        dt_init_std = self.dt_rank**-0.5 * options.dt_scale
        with torch.no_grad():
            if options.dt_init == "constant":
                nn.init.constant_(self.dt_proj.weight, dt_init_std)
            else:
                nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
            self.dt_proj.bias.copy_(
                sample_dt_bias(self.d_inner, options.dt_min, options.dt_max, options.dt_init_floor, **factory)
            )
        self.dt_proj.bias._no_reinit = True  # the LM-level init zeroes every other Linear bias

        # S4D-real init A = -(1..d_state) per channel, D = 1; both kept in float32 as mamba_ssm does.
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

        self.cp = split(cp)
        self.tp = None
        tp = split(tp)
        if tp is not None:
            self._shard(tp)

    def _shard(self, tp: TensorParallel) -> None:
        """Keep this rank's channels of every full tensor built above (see the module docstring)."""
        d_inner, d_model = self.d_inner, self.d_model
        self.in_proj = sharded(
            self.in_proj,
            lambda: ColumnParallelLinear(
                d_model,
                2 * d_inner,
                tp,
                bias=self.in_proj.bias is not None,
                components=[Component("x", d_inner), Component("z", d_inner)],
            ),
            tp,
        )
        self.conv1d = sharded(
            self.conv1d,
            lambda: ParallelDepthwiseConv1d(
                [Component("channels", d_inner)], self.d_conv, tp, bias=self.conv1d.bias is not None
            ),
            tp,
        )
        self.x_proj = sharded(
            self.x_proj,
            lambda: RowParallelLinear(
                d_inner, self.dt_rank + 2 * self.d_state, tp.without_sequence_parallel(), bias=False
            ),
            tp,
        )
        self.dt_proj.weight = shard_parameter(self.dt_proj.weight, split_rows("weight", d_inner), tp)
        self.dt_proj.bias = shard_parameter(self.dt_proj.bias, split_rows("bias", d_inner), tp)
        self.dt_proj.out_features = d_inner // tp.size
        self.A_log = shard_parameter(self.A_log, split_rows("A_log", d_inner), tp)
        self.D = shard_parameter(self.D, split_rows("D", d_inner), tp)
        self.out_proj = sharded(
            self.out_proj, lambda: RowParallelLinear(d_inner, d_model, tp, bias=self.out_proj.bias is not None), tp
        )
        self.tp, self.d_inner = tp, d_inner // tp.size

    # ---- splits of the fused projections -------------------------------------------------
    def split_in_proj(self, xz: torch.Tensor):
        """in_proj output (..., 2*d_inner) -> x, z (..., d_inner) each, in that order."""
        return torch.split(xz, [self.d_inner, self.d_inner], dim=-1)

    def split_x_proj(self, x_dbl: torch.Tensor):
        """x_proj output (..., dt_rank + 2*d_state) -> dt (..., dt_rank), B, C (..., d_state)."""
        return torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)

    def A(self) -> torch.Tensor:
        """The state matrix diagonal, (d_inner, d_state), float32 (or wider)."""
        return -torch.exp(fp32_or_wider(self.A_log))

    def conv_weight_and_bias(self):
        """The depthwise conv's (weight (d_inner, d_conv), bias) as the conv kernel takes them."""
        if self.tp is not None:
            return self.conv1d.weight_and_bias()
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    def project_x(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d_inner) -> x_proj(x) (..., dt_rank + 2*d_state). Under TP x_proj sums the ranks'
        partial products (all-reduce) and this rank's channels use the sum, so its gradient is summed too."""
        x_dbl = self.x_proj(x)
        return x_dbl if self.tp is None else copy_to_tp_region(x_dbl, self.tp)

    # ---- parallel form -------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        seq_idx: Optional[torch.Tensor] = None,
        inference_state: Optional[tuple] = None,
    ) -> torch.Tensor:
        """hidden_states (batch, seqlen, d_model); seq_idx (batch, seqlen) int32 document ids reset
        the conv and SSM state at document boundaries. With `inference_state` (conv_state, ssm_state)
        from `allocate_inference_cache`, the states after the last position are written into it."""
        ops = kernels if self.cp is None else ContextSlice(self.cp, seq_idx, self.d_conv)  # CP: continue earlier slices
        x, z = self.split_in_proj(self.in_proj(hidden_states))
        x, z = x.transpose(1, 2), z.transpose(1, 2)  # (batch, d_inner, seqlen)
        if inference_state is not None:
            inference_state[0].copy_(F.pad(x, (self.d_conv - x.shape[-1], 0)))
        x = ops.causal_conv1d(x, *self.conv_weight_and_bias(), seq_idx=seq_idx, activation="silu")

        dt, B, C = self.scan_inputs(x)
        y = ops.selective_scan(
            x,
            dt,
            self.A(),
            B,
            C,
            fp32_or_wider(self.D),
            z=z,
            delta_bias=fp32_or_wider(self.dt_proj.bias),
            delta_softplus=True,
            return_last_state=inference_state is not None,
            seq_idx=seq_idx,
        )
        if inference_state is not None:
            y, last_state = y
            inference_state[1].copy_(last_state)
        return self.out_proj(y.transpose(1, 2))

    def scan_inputs(self, x: torch.Tensor):
        """The conv output x (batch, d_inner, seqlen) -> dt (batch, d_inner, seqlen) before its bias,
        B, C (batch, d_state, seqlen)."""
        dt, B, C = self.split_x_proj(self.project_x(x.transpose(1, 2)))
        return (dt @ self.dt_proj.weight.t()).transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2)

    @property
    def output_projection(self) -> nn.Module:
        """The projection back onto the residual stream (initialised scaled by depth, as mamba_ssm)."""
        return self.out_proj

    # ---- recurrent form (generation) -------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, dtype=None) -> tuple:
        """Zero (conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state))."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def step(self, hidden_states: torch.Tensor, inference_state: tuple) -> torch.Tensor:
        """One token: hidden_states (batch, d_model) -> (batch, d_model); the states advance in place."""
        conv_state, ssm_state = inference_state
        x, z = self.split_in_proj(self.in_proj(hidden_states))
        weight, bias = self.conv_weight_and_bias()
        x = causal_conv1d_update(x, conv_state, weight, bias, activation="silu")
        dt, B, C = self.split_x_proj(self.project_x(x))
        dt = dt @ self.dt_proj.weight.t()
        y = selective_state_update(
            ssm_state,
            x,
            dt,
            self.A(),
            B,
            C,
            fp32_or_wider(self.D),
            z=z,
            dt_bias=fp32_or_wider(self.dt_proj.bias),
            dt_softplus=True,
        )
        return self.out_proj(y)
