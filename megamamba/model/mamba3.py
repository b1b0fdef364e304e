"""The Mamba-3 mixer: an exponential-trapezoidal SSM with data-dependent A, rotated B/C and, with MIMO, rank-R
inputs and outputs per head (Lahoti et al., 2026), on one device.

Parameter names, shapes and initialisation are mamba_ssm's `Mamba3`, so its state dicts load unchanged. No
conv; one in_proj with columns [z, x, B, C, dd_dt, dd_A, trap, angles]. The kernels' `mamba3_scan_inputs` turns
the columns into the scan's inputs and `mamba3_scan` scans (Triton on a GPU, SISO and MIMO, the preprocessing in
one fused kernel; the PyTorch reference otherwise); one-token decoding steps the reference recurrence.
With `tp` the mixer is built whole and `_shard` keeps this rank's heads (B/C split by group where ngroups % TP
== 0, else replicated; the angle columns and the B/C norms replicated, their gradients summed over TP); with
`cp` the scan continues the earlier slices (`megamamba.parallel.context.mamba3_slice`).
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.config import Mamba3Options
from megamamba.errors import LayoutError
from megamamba.kernels import mamba3_scan, mamba3_scan_inputs
from megamamba.kernels.reference.mamba3 import ScanState, mamba3_scan_recurrent
from megamamba.model.mamba1 import sample_dt_bias
from megamamba.model.norm import RMSNormGated
from megamamba.parallel import (
    ColumnParallelLinear,
    Component,
    RowParallelLinear,
    Shard,
    TensorParallel,
    copy_to_tp_region,
    mark,
    split,
)
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.context.mamba3_slice import Mamba3Slice
from megamamba.parallel.tensor.from_full import shard_parameter, sharded, split_rows


def check_mamba3_layout(d_model: int, options: Mamba3Options, tp_size: int) -> None:
    """Refuse a Mamba-3 mixer whose heads cannot be split across `tp_size` ranks (its B/C groups are split
    where ngroups % TP == 0 and replicated otherwise, so any ngroups is allowed)."""
    nheads = int(options.expand * d_model) // options.headdim
    if nheads % tp_size:
        raise LayoutError(
            f"Mamba3 tensor parallelism splits the heads across ranks: nheads = {nheads} "
            f"(expand x d_model / headdim) is not divisible by tp={tp_size}"
        )


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
        tp = split(tp)
        if tp is not None:
            check_mamba3_layout(d_model, options, tp.size)
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
        self.in_proj: nn.Module = nn.Linear(d_model, sum(widths), bias=False, **factory)
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
        self.out_proj: nn.Module = nn.Linear(self.d_inner, d_model, bias=False, **factory)

        self.cp = split(cp)
        self.tp: Optional[TensorParallel] = None
        # with B/C replicated over TP: the group each of this rank's heads reads
        self.head_groups: Optional[tuple] = None
        if tp is not None:
            self._shard(tp)

    def _shard(self, tp: TensorParallel) -> None:
        """Keep this rank's heads of every full tensor built above (see the module docstring)."""
        d_inner, nheads, ngroups, rank = self.d_inner, self.nheads, self.ngroups, self.rank
        groups_split = ngroups % tp.size == 0
        bc = self.d_state * ngroups  # one MIMO rank's B (or C) columns: in_proj lays them out (rank, group, state)
        per_rank = [
            Component(f"{name}{r}" if rank > 1 else name, bc, sharded=groups_split)
            for name in ("B", "C")
            for r in range(rank)
        ]
        components = [
            Component("z", d_inner),
            Component("x", d_inner),
            *per_rank,
            *(Component(name, nheads) for name in ("dd_dt", "dd_A", "trap")),
            Component("angles", self.nangles, sharded=False),
        ]
        self.in_proj = sharded(
            self.in_proj,
            lambda: ColumnParallelLinear(self.d_model, sum(self.in_proj_widths), tp, bias=False, components=components),
            tp,
        )
        for name in (
            "dt_bias",
            "D",
            "B_bias",
            "C_bias",
            *(("mimo_x", "mimo_z", "mimo_o") if self.options.is_mimo else ()),
        ):
            setattr(self, name, shard_parameter(getattr(self, name), split_rows(name, nheads, "heads"), tp))
        for norm in (self.B_norm, self.C_norm):  # used whole by every rank's heads: gradients summed over TP
            mark(norm.weight, Shard("weight", None, grad_reduced=True))
        if self.options.is_outproj_norm:  # a group per head: split with the heads
            self.norm.weight = shard_parameter(self.norm.weight, split_rows("weight", d_inner, "channels"), tp)
        self.out_proj = sharded(self.out_proj, lambda: RowParallelLinear(d_inner, self.d_model, tp, bias=False), tp)
        self.tp, self.d_inner, self.nheads = tp, d_inner // tp.size, nheads // tp.size
        if groups_split:
            self.ngroups = ngroups // tp.size
        else:
            heads = range(tp.rank * self.nheads, (tp.rank + 1) * self.nheads)
            self.head_groups = tuple(h // (nheads // ngroups) for h in heads)  # plain ints: no tensor state
        local_bc = self.d_state * self.ngroups * rank
        self.in_proj_widths = [self.d_inner, self.d_inner, local_bc, local_bc, *[self.nheads] * 3, self.nangles]

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
        if self.head_groups is not None:  # B/C replicated: each local head's group, as a group of its own
            index = torch.tensor(self.head_groups, device=B.device)
            B, C = B.index_select(-2, index), C.index_select(-2, index)
        inputs = mamba3_scan_inputs(
            B,
            C,
            dd_dt,
            dd_A,
            trap,
            angles,
            self.dt_bias,
            self._replicated(self.B_norm.weight),
            self._replicated(self.C_norm.weight),
            self.B_bias,
            self.C_bias,
            self.options.A_floor,
            a_activation=self.options.a_activation,
            rotation=self.rotation,
            seq_idx=seq_idx,
            initial_angle=initial_angle,
        )
        x = x.reshape(*lead, self.nheads, self.headdim).to(inputs.dt.dtype)
        values = x[..., None, :] * self.mimo_x if self.options.is_mimo else x[..., None, :]
        return z.reshape(*lead, self.nheads, self.headdim), values, inputs

    @property
    def rotation(self) -> str:
        """The pairs of state dimensions the angles rotate: adjacent (SISO) or (i, i + d_state/2) (MIMO)."""
        return "halves" if self.options.is_mimo else "adjacent"

    def _replicated(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight every TP rank holds whole and uses for its own heads: its gradient is summed over TP."""
        return weight if self.tp is None else copy_to_tp_region(weight, self.tp)

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
        scan: Callable = mamba3_scan
        if self.cp is not None:  # continue the earlier slices: their angle, state and last token
            context = Mamba3Slice(self.cp, seq_idx, scan, self.rotation)
            inputs, scan = context.continue_angle(inputs), context.scan
        y = scan(
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
        device = self.D.device
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
