"""The Mamba-2 mixer: state-space duality (SSD) with scalar-times-identity A per head (Dao & Gu, 2024).

Parameter names, shapes and initialisation are mamba_ssm's `Mamba2`, so its state dicts load
unchanged. With `tp` the mixer is built whole and `_shard` keeps this rank's heads; with `cp`
its conv and scan come from a `ContextSlice`. Parameter table, sharding and communication:
docs/code.md ("The model in code").
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba import kernels
from megamamba.config import Mamba2Options
from megamamba.kernels import causal_conv1d_update, selective_state_update
from megamamba.model.mamba1 import fp32_or_wider, sample_dt_bias
from megamamba.model.norm import RMSNormGated
from megamamba.parallel import ColumnParallelLinear, Component, RowParallelLinear, TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.context.context_slice import ContextSlice
from megamamba.parallel.tensor.conv import ParallelDepthwiseConv1d
from megamamba.parallel.tensor.from_full import shard_parameter, sharded, split_rows
from megamamba.parallel.tensor.model_layout import check_mixer_layout
from megamamba.parallel.tensor.spanning_norm import gated_rmsnorm_row_parallel


class Mamba2(nn.Module):
    """Mamba-2 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""

    def __init__(
        self,
        d_model: int,
        options: Mamba2Options = Mamba2Options(),
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
        self.conv1d = nn.Conv1d(
            conv_dim,
            conv_dim,
            kernel_size=self.d_conv,
            groups=conv_dim,
            padding=self.d_conv - 1,
            bias=options.conv_bias,
            **factory,
        )
        if options.conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -options.conv_init, options.conv_init)

        self.dt_bias = nn.Parameter(
            sample_dt_bias(self.nheads, options.dt_min, options.dt_max, options.dt_init_floor, **factory)
        )
        self.dt_bias._no_weight_decay = True
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*options.A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner if self.D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True

        if self.rmsnorm:
            self.norm = RMSNormGated(
                self.d_inner,
                eps=1e-5,
                group_size=self.d_inner // self.ngroups,
                norm_before_gate=options.norm_before_gate,
                **factory,
            )
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=options.bias, **factory)

        self.cp = split(cp)
        self.tp = None
        self.own_group = None  # with B/C replicated over TP: the group this rank's heads read
        self.norm_groups_across_ranks = None  # with norm groups spanning ranks: ngroups
        tp = split(tp)
        if tp is not None:
            self._shard(tp)

    def _shard(self, tp: TensorParallel) -> None:
        """Keep this rank's heads of every full tensor built above (see the module docstring)."""
        d_inner, nheads, ngroups, bc = self.d_inner, self.nheads, self.ngroups, self.ngroups * self.d_state
        groups_split = ngroups % tp.size == 0
        xBC = [
            Component("x", d_inner),
            Component("B", bc, sharded=groups_split),
            Component("C", bc, sharded=groups_split),
        ]
        self.in_proj = sharded(
            self.in_proj,
            lambda: ColumnParallelLinear(
                self.d_model,
                self.in_proj.out_features,
                tp,
                bias=self.in_proj.bias is not None,
                components=[Component("z", d_inner), *xBC, Component("dt", nheads)],
            ),
            tp,
        )
        self.conv1d = sharded(
            self.conv1d, lambda: ParallelDepthwiseConv1d(xBC, self.d_conv, tp, bias=self.conv1d.bias is not None), tp
        )
        self.dt_bias = shard_parameter(self.dt_bias, split_rows("dt_bias", nheads, "heads"), tp)
        self.A_log = shard_parameter(self.A_log, split_rows("A_log", nheads, "heads"), tp)
        self.D = shard_parameter(self.D, split_rows("D", self.D.shape[0], "heads"), tp)
        if self.rmsnorm:
            self.norm.weight = shard_parameter(self.norm.weight, split_rows("weight", d_inner, "channels"), tp)
        self.out_proj = sharded(
            self.out_proj, lambda: RowParallelLinear(d_inner, self.d_model, tp, bias=self.out_proj.bias is not None), tp
        )
        self.tp, self.d_inner, self.nheads = tp, d_inner // tp.size, nheads // tp.size
        if groups_split:
            self.ngroups = ngroups // tp.size
        else:
            self.own_group = tp.rank // (tp.size // ngroups)
            self.norm_groups_across_ranks = ngroups

    # ---- splits of the fused projection --------------------------------------------------
    def split_in_proj(self, zxbcdt: torch.Tensor):
        """in_proj output -> z (..., d_inner), xBC (..., d_inner + 2*ngroups*d_state), dt (..., nheads)."""
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        return torch.split(zxbcdt, [self.d_inner, conv_dim, self.nheads], dim=-1)

    def split_xBC(self, xBC: torch.Tensor):
        """conv output (..., conv_dim) -> x (..., nheads, headdim), B, C (..., ngroups, d_state);
        with B/C replicated over TP, only the group this rank's heads read (ngroups 1)."""
        gn = self.ngroups * self.d_state
        x, B, C = torch.split(xBC, [self.d_inner, gn, gn], dim=-1)
        lead = xBC.shape[:-1]
        B, C = B.reshape(*lead, self.ngroups, self.d_state), C.reshape(*lead, self.ngroups, self.d_state)
        if self.own_group is not None:
            B, C = B[..., self.own_group : self.own_group + 1, :], C[..., self.own_group : self.own_group + 1, :]
        return x.reshape(*lead, self.nheads, self.headdim), B, C

    def conv_weight_and_bias(self):
        """The depthwise conv's (weight (conv_dim, d_conv), bias) as the conv kernel takes them."""
        if self.tp is not None:
            return self.conv1d.weight_and_bias()
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    def A(self) -> torch.Tensor:
        """Per-head decay rate, (nheads,), float32 (or wider)."""
        return -torch.exp(fp32_or_wider(self.A_log))

    def D_per_head(self) -> torch.Tensor:
        """D as the scan takes it: (nheads,), or (nheads, headdim) with D_has_hdim."""
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def gate_and_project(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z (..., d_inner) -> out_proj(norm(y, z)); without rmsnorm the gate was applied in the scan."""
        if self.rmsnorm and self.norm_groups_across_ranks is not None:
            return gated_rmsnorm_row_parallel(
                y,
                z,
                self.norm.weight,
                eps=self.norm.eps,
                group_size=self.norm.group_size,
                ngroups=self.norm_groups_across_ranks,
                norm_before_gate=self.norm.norm_before_gate,
                out_proj=self.out_proj,
            )
        if self.rmsnorm:
            y = self.norm(y, z)
        return self.out_proj(y)

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
        z, xBC, dt = self.split_in_proj(self.in_proj(hidden_states))
        batch, seqlen, _ = z.shape  # sequence parallelism gathers the sequence in in_proj
        xBC = xBC.transpose(1, 2)  # (batch, conv_dim, seqlen)
        if inference_state is not None:
            inference_state[0].copy_(F.pad(xBC, (self.d_conv - seqlen, 0)))
        xBC = ops.causal_conv1d(xBC, *self.conv_weight_and_bias(), seq_idx=seq_idx, activation="silu").transpose(1, 2)
        x, B, C = self.split_xBC(xBC)
        y = ops.ssd_chunk_scan(
            x,
            dt,
            self.A(),
            B,
            C,
            self.chunk_size,
            D=self.D_per_head(),
            z=None if self.rmsnorm else z.reshape_as(x),
            dt_bias=self.dt_bias,
            seq_idx=seq_idx,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            return_final_states=inference_state is not None,
        )
        if inference_state is not None:
            y, final_state = y
            inference_state[1].copy_(final_state)
        return self.gate_and_project(y.reshape(batch, seqlen, self.d_inner), z)

    @property
    def output_projection(self) -> nn.Module:
        """The projection back onto the residual stream (initialised scaled by depth, as mamba_ssm)."""
        return self.out_proj

    # ---- recurrent form (generation) -------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, dtype=None) -> tuple:
        """Zero (conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim, d_state))."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.in_proj.weight.dtype if dtype is None else dtype
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        conv_state = torch.zeros(batch_size, conv_dim, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def step(self, hidden_states: torch.Tensor, inference_state: tuple) -> torch.Tensor:
        """One token: hidden_states (batch, d_model) -> (batch, d_model); the states advance in place."""
        conv_state, ssm_state = inference_state
        z, xBC, dt = self.split_in_proj(self.in_proj(hidden_states))
        weight, bias = self.conv_weight_and_bias()
        xBC = causal_conv1d_update(xBC, conv_state, weight, bias, activation="silu")
        x, B, C = self.split_xBC(xBC)
        # dt as the scan computes it (bias, softplus, dt_limit), then broadcast over each head's channels.
        dt = F.softplus(fp32_or_wider(dt) + fp32_or_wider(self.dt_bias)).clamp(*self.dt_limit)
        per_channel = (self.nheads, self.headdim)
        y = selective_state_update(
            ssm_state,
            x,
            dt[..., None].expand(-1, *per_channel),
            self.A()[:, None, None].expand(*per_channel, self.d_state),
            B,
            C,
            D=fp32_or_wider(self.D_per_head()).reshape(self.nheads, -1).expand(per_channel),
            z=None if self.rmsnorm else z.reshape_as(x),
        )
        return self.gate_and_project(y.reshape(-1, self.d_inner), z)
