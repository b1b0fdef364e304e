"""The Mamba-3 mixer: an exponential-trapezoidal SSM with data-dependent A, rotated B/C and, with MIMO, rank-R
inputs and outputs per head (Lahoti et al., 2026), on one device.

Parameter names, shapes and initialisation are mamba_ssm's `Mamba3`, so its state dicts load unchanged. No
conv; one in_proj with columns [z, x, B, C, dd_dt, dd_A, trap, angles]. The scan is the PyTorch reference
(`megamamba.kernels.reference.mamba3`); tensor and context parallelism are refused for now.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.config import Mamba3Options
from megamamba.errors import LayoutError
from megamamba.kernels.reference.mamba3 import ScanState, mamba3_scan_chunked, mamba3_scan_recurrent
from megamamba.kernels.reference.mamba3_inputs import mamba3_scan_inputs
from megamamba.model.mamba1 import sample_dt_bias
from megamamba.model.norm import RMSNormGated
from megamamba.parallel import TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel


class Mamba3(nn.Module):
    """Mamba-3 mixer (SISO, or MIMO of rank mimo_rank): (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""

    def __init__(
        self,
        d_model: int,
        options: Mamba3Options,
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        for name, short, group in (("tensor", "tp", split(tp)), ("context", "cp", split(cp))):
            if group is not None:
                raise LayoutError(
                    f"Mamba3 with {name} parallelism ({short}={group.size}) is not implemented yet; use {short} 1"
                )
        factory = {"device": device, "dtype": dtype}
        self.options = options
        self.d_model = d_model
        self.d_state = options.d_state
        self.d_inner = int(options.expand * d_model)
        self.headdim = options.headdim
        self.nheads = self.d_inner // self.headdim
        self.ngroups = options.ngroups
        self.rank = options.rank
        self.nangles = options.num_rope_angles
        self.chunk_size = options.chunk_size

        bc = self.d_state * self.ngroups * self.rank
        widths = [self.d_inner, self.d_inner, bc, bc, self.nheads, self.nheads, self.nheads, self.nangles]
        self.in_proj_widths = widths
        self.in_proj = nn.Linear(d_model, sum(widths), bias=False, **factory)
        self.dt_bias = nn.Parameter(
            sample_dt_bias(self.nheads, options.dt_min, options.dt_max, options.dt_init_floor, device, torch.float32)
        )
        per_rank = (self.nheads, self.rank, self.d_state)
        self.B_bias = nn.Parameter(torch.ones(per_rank, dtype=torch.float32, device=device))
        self.C_bias = nn.Parameter(torch.ones(per_rank, dtype=torch.float32, device=device))
        self.B_norm = RMSNormGated(self.d_state, eps=1e-5, **factory)
        self.C_norm = RMSNormGated(self.d_state, eps=1e-5, **factory)
        if options.is_mimo:
            mimo = (self.nheads, self.rank, self.headdim)
            self.mimo_x = nn.Parameter(torch.ones(mimo, device=device) / self.rank)
            self.mimo_z = nn.Parameter(torch.ones(mimo, device=device))
            self.mimo_o = nn.Parameter(torch.ones(mimo, device=device) / self.rank)
        self.D = nn.Parameter(torch.ones(self.nheads, device=device))
        for param in (self.dt_bias, self.D):  # as mamba_ssm marks them
            param._no_weight_decay = True  # type: ignore[attr-defined]
        if options.is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, group_size=self.headdim, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, **factory)

    @property
    def output_projection(self) -> nn.Module:
        """The projection back onto the residual stream (initialised scaled by depth, as mamba_ssm)."""
        return self.out_proj

    def _project(self, hidden_states: torch.Tensor, seq_idx=None, initial_angle=None):
        """in_proj and the preprocessing: z (..., nheads, headdim), the scan's values (..., nheads, rank, headdim)
        and its other inputs (`ScanInputs`)."""
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(self.in_proj(hidden_states), self.in_proj_widths, dim=-1)
        lead = x.shape[:-1]
        B = B.reshape(*lead, self.rank, self.ngroups, self.d_state)
        C = C.reshape(*lead, self.rank, self.ngroups, self.d_state)
        inputs = mamba3_scan_inputs(
            B,
            C,
            dd_dt,
            dd_A,
            trap,
            angles,
            self.dt_bias,
            self.B_norm.weight,
            self.C_norm.weight,
            self.B_bias,
            self.C_bias,
            self.options.A_floor,
            a_activation=self.options.a_activation,
            rotation="halves" if self.options.is_mimo else "adjacent",
            seq_idx=seq_idx,
            initial_angle=initial_angle,
        )
        x = x.reshape(*lead, self.nheads, self.headdim).to(inputs.dt.dtype)
        values = x[..., None, :] * self.mimo_x if self.options.is_mimo else x[..., None, :]
        return z.reshape(*lead, self.nheads, self.headdim), values, inputs

    def _gate_and_project(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y (..., nheads, rank, headdim), z (..., nheads, headdim) -> out_proj of the gated output (summed over
        the ranks by mimo_o with MIMO), with is_outproj_norm through the per-head gated RMSNorm."""
        z = z.to(y.dtype)[..., None, :]
        if self.options.is_mimo:
            z = z * self.mimo_z
        if self.options.is_outproj_norm:
            flat = y.transpose(-3, -2).flatten(-2)  # (..., rank, nheads * headdim): the norm's channels
            gated = self.norm(flat, z.transpose(-3, -2).flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
            gated = gated.transpose(-3, -2)
        else:
            gated = y * F.silu(z)
        gated = (gated * self.mimo_o).sum(-2) if self.options.is_mimo else gated.squeeze(-2)
        return self.out_proj(gated.flatten(-2).to(dtype))

    def forward(
        self,
        hidden_states: torch.Tensor,
        seq_idx: Optional[torch.Tensor] = None,
        inference_state: Optional[tuple] = None,
    ) -> torch.Tensor:
        """hidden_states (batch, seqlen, d_model); seq_idx (batch, seqlen) int32 document ids reset the state,
        the angle and the previous-token term at each document start. With `inference_state` from
        `allocate_inference_cache`, the state after the last position is written into it."""
        z, values, inputs = self._project(hidden_states, seq_idx)
        y = mamba3_scan_chunked(
            values,
            inputs.dt,
            inputs.A,
            inputs.lam,
            inputs.B,
            inputs.C,
            self.chunk_size,
            D=self.D,
            seq_idx=seq_idx,
            return_final_state=inference_state is not None,
        )
        if inference_state is not None:
            y, final = y
            for slot, value in zip(inference_state, (inputs.angle[:, -1], *final)):
                slot.copy_(value)
        return self._gate_and_project(y, z, hidden_states.dtype)

    # ---- recurrent form (generation) -------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, dtype=None) -> tuple:
        """Zero (angle (batch, nheads, nangles), ssm (batch, nheads, headdim, d_state), the previous token's
        values (batch, nheads, rank, headdim) and B̂ (batch, nheads, rank, d_state)), in float32."""
        device = self.out_proj.weight.device
        state_dtype = torch.float32 if dtype is None else torch.promote_types(dtype, torch.float32)
        h, r = self.nheads, self.rank
        shapes = ((h, self.nangles), (h, self.headdim, self.d_state), (h, r, self.headdim), (h, r, self.d_state))
        return tuple(torch.zeros(batch_size, *shape, device=device, dtype=state_dtype) for shape in shapes)

    def step(self, hidden_states: torch.Tensor, inference_state: tuple) -> torch.Tensor:
        """One token: hidden_states (batch, d_model) -> (batch, d_model); the state advances in place."""
        angle, ssm, prev_values, prev_B = inference_state
        z, values, inputs = self._project(hidden_states[:, None], initial_angle=angle)
        y, final = mamba3_scan_recurrent(
            values,
            inputs.dt,
            inputs.A,
            inputs.lam,
            inputs.B,
            inputs.C,
            D=self.D,
            initial_state=ScanState(ssm, prev_values, prev_B),
            return_final_state=True,
        )
        for slot, value in zip(inference_state, (inputs.angle[:, -1], *final)):
            slot.copy_(value)
        return self._gate_and_project(y, z, hidden_states.dtype)[:, 0]
