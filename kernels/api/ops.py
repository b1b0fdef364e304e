"""The kernels as PyTorch custom ops (`torch.ops.megamamba.*`): torch.compile traces each as one node and
FlopCounterMode counts it by its formula (`flops`).

Each op runs Triton or the reference as `choice.backend` says when it runs; its fake implementation gives
the outputs' shapes, strides and dtypes of the backend it would run. Its gradients come from a second op:
Triton's backward kernels, or the reference run again under autograd (`reference_grads`). The ops take
the public functions' arguments (dispatch.py) with their defaults resolved, and the autocast dtype the
reference computes under (None: off). How and why: docs/code.md ("The kernels as custom ops").
"""

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import flops
from .choice import backend, triton
from .reference import step
from .reference.add_norm import add_rmsnorm as reference_add_rmsnorm
from .reference.common import compute_dtype
from .reference.conv import causal_conv1d as reference_causal_conv1d
from .reference.mamba3 import ScanState
from .reference.mamba3 import mamba3_scan_chunked as reference_mamba3_scan
from .reference.mamba3_inputs import mamba3_scan_inputs as reference_mamba3_scan_inputs
from .reference.norm import rmsnorm_gated as reference_rmsnorm_gated
from .reference.selective_scan import selective_scan as reference_selective_scan
from .reference.ssd import ssd_chunk_scan as reference_ssd_chunk_scan
from .reference_grads import autocast_to, reference_grads


def _absent(like: Tensor) -> Tensor:
    """The placeholder for an output or gradient that does not exist (an op returns tensors only)."""
    return like.new_empty(0)


def _or_absent(t: Optional[Tensor], like: Tensor) -> Tensor:
    return _absent(like) if t is None else t


def _all_or_absent(grads, like: Tensor) -> Any:
    """The gradients as an op returns them: the placeholder for each absent one."""
    return tuple(_or_absent(g, like) for g in grads)


def _zeros_like(x: Tensor) -> Tensor:
    """The gradient of an unused output shaped like x (the scans' outputs are)."""
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


def _grads_like(inputs) -> tuple:
    """Fake gradients: contiguous, one per input, the placeholder for an absent one."""
    first = next(t for t in inputs if t is not None)
    return tuple(_absent(first) if t is None else t.new_empty(t.shape) for t in inputs)


def _conv_layout(x: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty (batch, dim, seqlen) tensor in x's layout, as Triton's conv writes its output and dx:
    channel-last when x is (Mamba-2's transposed slice), else contiguous."""
    batch, dim, seqlen = x.shape
    if x.stride(1) == 1 and x.stride(2) != 1:
        return x.new_empty((batch, seqlen, dim), dtype=dtype).transpose(1, 2)
    return x.new_empty((batch, dim, seqlen), dtype=dtype)


def _in_conv_layout(x: Tensor, t: Tensor) -> Tensor:
    out = _conv_layout(x, t.dtype)
    return t if t.stride() == out.stride() else out.copy_(t)


# ---- causal_conv1d ------------------------------------------------------------------------------


@torch.library.custom_op("megamamba::causal_conv1d", mutates_args=())
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    seq_idx: Optional[Tensor],
    activation: Optional[str],
    autocast: Optional[torch.dtype],
) -> Tensor:
    if backend(x) == "triton":
        return triton("conv").forward(x, weight, bias, seq_idx, activation)
    with autocast_to(x.device.type, autocast):
        out = reference_causal_conv1d(x, weight, bias, seq_idx, activation)
    return _in_conv_layout(x, out)


@causal_conv1d.register_fake
def _(x, weight, bias, seq_idx, activation, autocast):
    return _conv_layout(x, x.dtype)


@torch.library.custom_op("megamamba::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    dout: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    seq_idx: Optional[Tensor],
    activation: Optional[str],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor]:
    if backend(x) == "triton":
        dx, dweight, dbias = triton("conv").backward(dout, x, weight, bias, seq_idx, activation)
    else:
        dx, dweight, dbias = reference_grads(
            reference_causal_conv1d,
            dict(x=x, weight=weight, bias=bias, seq_idx=seq_idx),
            dict(activation=activation),
            (dout,),
            autocast,
            ("x", "weight", "bias"),
        )
        dx = _in_conv_layout(x, dx)
    return dx, dweight, _or_absent(dbias, x)


@causal_conv1d_backward.register_fake
def _(dout, x, weight, bias, seq_idx, activation, autocast):
    return _conv_layout(x, x.dtype), *_grads_like((weight, bias))


def _conv_setup(ctx, inputs, output):
    x, weight, bias, seq_idx, activation, autocast = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.options = (activation, autocast)


def _conv_backward(ctx, dout):
    x, weight, bias, seq_idx = ctx.saved_tensors
    dx, dweight, dbias = causal_conv1d_backward(dout, x, weight, bias, seq_idx, *ctx.options)
    return dx, dweight, None if bias is None else dbias, None, None, None


causal_conv1d.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---- rmsnorm_gated ------------------------------------------------------------------------------


@torch.library.custom_op("megamamba::rmsnorm_gated", mutates_args=())
def rmsnorm_gated(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    z: Optional[Tensor],
    eps: float,
    group_size: Optional[int],
    norm_before_gate: bool,
    autocast: Optional[torch.dtype],
) -> Tensor:
    if backend(x) == "triton":
        return triton("norm").forward(x, weight, bias, z, eps, group_size, norm_before_gate)
    with autocast_to(x.device.type, autocast):
        return reference_rmsnorm_gated(x, weight, bias, z, eps, group_size, norm_before_gate).contiguous()


@rmsnorm_gated.register_fake
def _(x, weight, bias, z, eps, group_size, norm_before_gate, autocast):
    return x.new_empty(x.shape)


@torch.library.custom_op("megamamba::rmsnorm_gated_backward", mutates_args=())
def rmsnorm_gated_backward(
    dout: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    z: Optional[Tensor],
    eps: float,
    group_size: Optional[int],
    norm_before_gate: bool,
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend(x) == "triton":
        grads = triton("norm").backward(dout, x, weight, bias, z, eps, group_size, norm_before_gate)
    else:
        grads = reference_grads(
            reference_rmsnorm_gated,
            dict(x=x, weight=weight, bias=bias, z=z),
            dict(eps=eps, group_size=group_size, norm_before_gate=norm_before_gate),
            (dout,),
            autocast,
            ("x", "weight", "bias", "z"),
        )
    return _all_or_absent(grads, x)


@rmsnorm_gated_backward.register_fake
def _(dout, x, weight, bias, z, eps, group_size, norm_before_gate, autocast):
    return _grads_like((x, weight, bias, z))


def _norm_setup(ctx, inputs, output):
    x, weight, bias, z, *options = inputs
    ctx.save_for_backward(x, weight, bias, z)
    ctx.options = options


def _norm_backward(ctx, dout):
    x, weight, bias, z = ctx.saved_tensors
    dx, dweight, dbias, dz = rmsnorm_gated_backward(dout, x, weight, bias, z, *ctx.options)
    return dx, dweight, None if bias is None else dbias, None if z is None else dz, None, None, None, None


rmsnorm_gated.register_autograd(_norm_backward, setup_context=_norm_setup)


# ---- add_rmsnorm --------------------------------------------------------------------------------


def _residual_dtype(x: Tensor, residual: Optional[Tensor], residual_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The new residual's dtype: residual_dtype, else that of x + residual."""
    if residual_dtype is not None:
        return residual_dtype
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _stores_residual(x, residual, residual_dtype) -> bool:
    """Whether the new residual is a tensor of its own (not x itself)."""
    return residual is not None or _residual_dtype(x, residual, residual_dtype) != x.dtype


def _fused(x, residual, weight, residual_dtype) -> bool:
    return backend(x) == "triton" and triton("add_norm").fused(x, residual, weight, residual_dtype)


@torch.library.custom_op("megamamba::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Tensor,
    eps: float,
    residual_dtype: Optional[torch.dtype],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor]:
    """(the norm, the new residual; the placeholder when that is x itself, which the caller returns)."""
    stores = _stores_residual(x, residual, residual_dtype)
    if _fused(x, residual, weight, residual_dtype):
        normed, r = triton("add_norm").forward(x, residual, weight, eps, _residual_dtype(x, residual, residual_dtype))
    else:
        with autocast_to(x.device.type, autocast):
            normed, r = reference_add_rmsnorm(x, residual, weight, eps, residual_dtype)
        normed, r = normed.contiguous(), r.contiguous() if stores else None
    return normed, _or_absent(r, x)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps, residual_dtype, autocast):
    stores = _stores_residual(x, residual, residual_dtype)
    r = x.new_empty(x.shape, dtype=_residual_dtype(x, residual, residual_dtype)) if stores else _absent(x)
    return x.new_empty(x.shape, dtype=weight.dtype), r


@torch.library.custom_op("megamamba::add_rmsnorm_backward", mutates_args=())
def add_rmsnorm_backward(
    dnormed: Optional[Tensor],
    dresidual_out: Optional[Tensor],
    x: Tensor,
    residual: Optional[Tensor],
    weight: Tensor,
    residual_out: Tensor,
    eps: float,
    residual_dtype: Optional[torch.dtype],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dresidual, dweight) given the outputs' gradients (None: unused) and the forward's residual_out."""
    if _fused(x, residual, weight, residual_dtype):
        r = residual_out if _stores_residual(x, residual, residual_dtype) else x
        grads = triton("add_norm").backward(
            dnormed, dresidual_out, r, weight, eps, x.dtype, None if residual is None else residual.dtype
        )
    else:
        grads = reference_grads(
            reference_add_rmsnorm,
            dict(x=x, residual=residual, weight=weight),
            dict(eps=eps, residual_dtype=residual_dtype),
            (dnormed, dresidual_out),
            autocast,
            ("x", "residual", "weight"),
        )
    return _all_or_absent(grads, x)


@add_rmsnorm_backward.register_fake
def _(dnormed, dresidual_out, x, residual, weight, residual_out, eps, residual_dtype, autocast):
    return _grads_like((x, residual, weight))


def _add_norm_setup(ctx, inputs, output):
    x, residual, weight, eps, residual_dtype, autocast = inputs
    ctx.save_for_backward(x, residual, weight, output[1])
    ctx.options = (eps, residual_dtype, autocast)
    ctx.stores = _stores_residual(x, residual, residual_dtype)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as the kernel expects


def _add_norm_backward(ctx, dnormed, dresidual_out):
    x, residual, weight, residual_out = ctx.saved_tensors
    dx, dresidual, dweight = add_rmsnorm_backward(
        dnormed, dresidual_out if ctx.stores else None, x, residual, weight, residual_out, *ctx.options
    )
    return dx, None if residual is None else dresidual, dweight, None, None, None


add_rmsnorm.register_autograd(_add_norm_backward, setup_context=_add_norm_setup)


# ---- ssd_chunk_scan -----------------------------------------------------------------------------

_SSD_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@torch.library.custom_op("megamamba::ssd_chunk_scan", mutates_args=())
def ssd_chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    z: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_states: Optional[Tensor],
    seq_idx: Optional[Tensor],
    dt_softplus: bool,
    dt_limit: list[float],
    return_final_states: bool,
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor]:
    """(y, the final states; the placeholder unless return_final_states)."""
    if backend(x) == "triton":
        y, final = triton("ssd").forward(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit
        )
    else:
        with autocast_to(x.device.type, autocast):
            y, final = reference_ssd_chunk_scan(
                x,
                dt,
                A,
                B,
                C,
                chunk_size,
                D,
                z,
                dt_bias,
                initial_states,
                seq_idx,
                dt_softplus,
                dt_limit,
                return_final_states=True,
            )
        y, final = y.contiguous(), final.contiguous()
    return y, final if return_final_states else _absent(x)


@ssd_chunk_scan.register_fake
def _(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D,
    z,
    dt_bias,
    initial_states,
    seq_idx,
    dt_softplus,
    dt_limit,
    return_final_states,
    autocast,
):
    if not return_final_states:
        return x.new_empty(x.shape), _absent(x)
    dtype = torch.float32 if backend(x) == "triton" else compute_dtype(x)
    batch, _, nheads, headdim = x.shape
    return x.new_empty(x.shape), x.new_empty((batch, nheads, headdim, B.shape[3]), dtype=dtype)


@torch.library.custom_op("megamamba::ssd_chunk_scan_backward", mutates_args=())
def ssd_chunk_scan_backward(
    dy: Tensor,
    dfinal: Optional[Tensor],
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    z: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_states: Optional[Tensor],
    seq_idx: Optional[Tensor],
    dt_softplus: bool,
    dt_limit: list[float],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states) given dy and dfinal (None: unused)."""
    if backend(x) == "triton":
        grads = triton("ssd").backward(
            dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit
        )
    else:
        tensors = dict(
            x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx
        )
        options = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True)
        grads = reference_grads(reference_ssd_chunk_scan, tensors, options, (dy, dfinal), autocast, _SSD_INPUTS)
    return _all_or_absent(grads, x)


@ssd_chunk_scan_backward.register_fake
def _(dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, *options):
    return _grads_like((x, dt, A, B, C, D, z, dt_bias, initial_states))


def _ssd_setup(ctx, inputs, output):
    x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, *options = inputs
    dt_softplus, dt_limit, return_final_states, autocast = options
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    ctx.options = (chunk_size, dt_softplus, dt_limit, autocast)
    ctx.returns_final = return_final_states
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as the kernel expects


def _ssd_backward(ctx, dy, dfinal):
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx = ctx.saved_tensors
    chunk_size, dt_softplus, dt_limit, autocast = ctx.options
    dy = _zeros_like(x) if dy is None else dy  # only the final states are used
    grads = ssd_chunk_scan_backward(
        dy,
        dfinal if ctx.returns_final else None,
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
        dt_softplus,
        dt_limit,
        autocast,
    )
    present = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = (None if t is None else g for g, t in zip(grads, present))
    return dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit, None, None, None, None, None


ssd_chunk_scan.register_autograd(_ssd_backward, setup_context=_ssd_setup)


# ---- mamba3_scan --------------------------------------------------------------------------------

_MAMBA3_INPUTS = ("x", "dt", "A", "lam", "B", "C", "D", "initial_ssm", "initial_x", "initial_B")


def _mamba3_on_triton(x: Tensor) -> bool:
    """Whether Triton runs this scan (SISO and MIMO alike): on the Triton backend."""
    return backend(x) == "triton"


def _scan_state(ssm, x, B):
    """The initial ScanState from the op's three tensors (given together or not at all), None without."""
    return None if ssm is None else ScanState(ssm, x, B)


def _reference_mamba3(x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx, chunk_size):
    """The reference's (y, final ssm, x and B̂) in x's compute dtype, the state as separate tensors."""
    initial = _scan_state(initial_ssm, initial_x, initial_B)
    y, final = reference_mamba3_scan(
        x, dt, A, lam, B, C, chunk_size, D=D, initial_state=initial, seq_idx=seq_idx, return_final_state=True
    )
    ct = compute_dtype(x)
    return tuple(t.to(ct) for t in (y, *final))


@torch.library.custom_op("megamamba::mamba3_scan", mutates_args=())
def mamba3_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    lam: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    initial_ssm: Optional[Tensor],
    initial_x: Optional[Tensor],
    initial_B: Optional[Tensor],
    seq_idx: Optional[Tensor],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, the final ssm, x and B̂) in x's compute dtype; the final x and B̂ are copies (an op's outputs never
    alias its inputs)."""
    if _mamba3_on_triton(x):
        initial = _scan_state(initial_ssm, initial_x, initial_B)
        return triton("mamba3").forward(x, dt, A, lam, B, C, chunk_size, D, initial, seq_idx)
    with autocast_to(x.device.type, autocast):
        y, ssm, last_x, last_B = _reference_mamba3(
            x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx, chunk_size
        )
    return y.contiguous(), ssm.contiguous(), last_x.clone(), last_B.clone()


@mamba3_scan.register_fake
def _(x, dt, A, lam, B, C, chunk_size, D, initial_ssm, initial_x, initial_B, seq_idx, autocast):
    batch, _, nheads, rank, headdim = x.shape
    dtype = compute_dtype(x)
    shapes = (x.shape, (batch, nheads, headdim, B.shape[-1]), (batch, nheads, rank, headdim), B[:, 0].shape)
    return tuple(x.new_empty(shape, dtype=dtype) for shape in shapes)


@torch.library.custom_op("megamamba::mamba3_scan_backward", mutates_args=())
def mamba3_scan_backward(
    dy: Optional[Tensor],
    dssm: Optional[Tensor],
    dlast_x: Optional[Tensor],
    dlast_B: Optional[Tensor],
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    lam: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor],
    initial_ssm: Optional[Tensor],
    initial_x: Optional[Tensor],
    initial_B: Optional[Tensor],
    seq_idx: Optional[Tensor],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, ddt, dA, dlam, dB, dC, dD, dinitial ssm, x and B̂) given the outputs' gradients (None: unused)."""
    if _mamba3_on_triton(x):
        initial = _scan_state(initial_ssm, initial_x, initial_B)
        grads = triton("mamba3").backward(
            dy, dssm, dlast_x, dlast_B, x, dt, A, lam, B, C, chunk_size, D, initial, seq_idx
        )
        return _all_or_absent(grads, x)
    tensors = dict(
        x=x,
        dt=dt,
        A=A,
        lam=lam,
        B=B,
        C=C,
        D=D,
        initial_ssm=initial_ssm,
        initial_x=initial_x,
        initial_B=initial_B,
        seq_idx=seq_idx,
    )
    output_grads = (dy, dssm, dlast_x, dlast_B)
    grads = reference_grads(
        _reference_mamba3, tensors, dict(chunk_size=chunk_size), output_grads, autocast, _MAMBA3_INPUTS
    )
    return _all_or_absent(grads, x)


@mamba3_scan_backward.register_fake
def _(dy, dssm, dlast_x, dlast_B, x, dt, A, lam, B, C, chunk_size, D, initial_ssm, initial_x, initial_B, *rest):
    return _grads_like((x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B))


def _mamba3_setup(ctx, inputs, output):
    x, dt, A, lam, B, C, chunk_size, D, initial_ssm, initial_x, initial_B, seq_idx, autocast = inputs
    ctx.save_for_backward(x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx)
    ctx.options = (chunk_size, autocast)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None


def _mamba3_backward(ctx, dy, dssm, dlast_x, dlast_B):
    x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B, seq_idx = ctx.saved_tensors
    chunk_size, autocast = ctx.options
    grads = mamba3_scan_backward(
        dy,
        dssm,
        dlast_x,
        dlast_B,
        x,
        dt,
        A,
        lam,
        B,
        C,
        chunk_size,
        D,
        initial_ssm,
        initial_x,
        initial_B,
        seq_idx,
        autocast,
    )
    present = (x, dt, A, lam, B, C, D, initial_ssm, initial_x, initial_B)
    dx, ddt, dA, dlam, dB, dC, dD, dssm0, dx0, dB0 = (None if t is None else g for g, t in zip(grads, present))
    return dx, ddt, dA, dlam, dB, dC, None, dD, dssm0, dx0, dB0, None, None


mamba3_scan.register_autograd(_mamba3_backward, setup_context=_mamba3_setup)


# ---- mamba3_scan_inputs -------------------------------------------------------------------------

_MAMBA3_PREPROCESSED = (
    "B", "C", "dd_dt", "dd_A", "trap", "angles", "dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias",
    "initial_angle",
)  # fmt: skip


def _mamba3_inputs_on_triton(B: Tensor) -> bool:
    """Whether Triton preprocesses: on the Triton backend, in float32 (float64 stays on the reference)."""
    return backend(B) == "triton" and compute_dtype(B) == torch.float32


@torch.library.custom_op("megamamba::mamba3_scan_inputs", mutates_args=())
def mamba3_scan_inputs(
    B: Tensor,
    C: Tensor,
    dd_dt: Tensor,
    dd_A: Tensor,
    trap: Tensor,
    angles: Tensor,
    dt_bias: Tensor,
    B_norm_weight: Tensor,
    C_norm_weight: Tensor,
    B_bias: Tensor,
    C_bias: Tensor,
    A_floor: float,
    a_activation: str,
    rotation: str,
    norm_eps: float,
    seq_idx: Optional[Tensor],
    initial_angle: Optional[Tensor],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Mamba-3's scan inputs (B̂, Ĉ, Δ, A, λ, the angle) in B's compute dtype."""
    args = (B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, A_floor)
    if _mamba3_inputs_on_triton(B):
        out = triton("mamba3_inputs").forward(*args, a_activation, rotation, norm_eps, seq_idx, initial_angle)
    else:
        with autocast_to(B.device.type, autocast):
            out = reference_mamba3_scan_inputs(*args, a_activation, rotation, norm_eps, seq_idx, initial_angle)
    return out.B, out.C, out.dt, out.A, out.lam, out.angle


@mamba3_scan_inputs.register_fake
def _(B, C, dd_dt, dd_A, trap, angles, *rest):
    batch, seqlen, rank, _, dstate = B.shape
    nheads, nangles = dd_dt.shape[-1], angles.shape[-1]
    dtype = compute_dtype(B)
    shapes = [(batch, seqlen, nheads, rank, dstate)] * 2 + [(batch, seqlen, nheads)] * 3
    return tuple(B.new_empty(shape, dtype=dtype) for shape in (*shapes, (batch, seqlen, nheads, nangles)))


@torch.library.custom_op("megamamba::mamba3_scan_inputs_backward", mutates_args=())
def mamba3_scan_inputs_backward(
    dB_hat: Optional[Tensor],
    dC_hat: Optional[Tensor],
    ddt: Optional[Tensor],
    dA: Optional[Tensor],
    dlam: Optional[Tensor],
    dangle: Optional[Tensor],
    angle: Tensor,
    B: Tensor,
    C: Tensor,
    dd_dt: Tensor,
    dd_A: Tensor,
    trap: Tensor,
    angles: Tensor,
    dt_bias: Tensor,
    B_norm_weight: Tensor,
    C_norm_weight: Tensor,
    B_bias: Tensor,
    C_bias: Tensor,
    A_floor: float,
    a_activation: str,
    rotation: str,
    norm_eps: float,
    seq_idx: Optional[Tensor],
    initial_angle: Optional[Tensor],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `mamba3_scan_inputs`'s tensors given its outputs' (None: unused); `angle` is its
    angle output."""
    output_grads = (dB_hat, dC_hat, ddt, dA, dlam, dangle)
    if _mamba3_inputs_on_triton(B):
        grads = triton("mamba3_inputs").backward(
            output_grads, angle, B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight,
            B_bias, C_bias, A_floor, a_activation, rotation, norm_eps, seq_idx,
        )  # fmt: skip
        return _all_or_absent((*grads[:-1], None if initial_angle is None else grads[-1]), B)
    tensors = dict(
        B=B,
        C=C,
        dd_dt=dd_dt,
        dd_A=dd_A,
        trap=trap,
        angles=angles,
        dt_bias=dt_bias,
        B_norm_weight=B_norm_weight,
        C_norm_weight=C_norm_weight,
        B_bias=B_bias,
        C_bias=C_bias,
        seq_idx=seq_idx,
        initial_angle=initial_angle,
    )
    options = dict(A_floor=A_floor, a_activation=a_activation, rotation=rotation, norm_eps=norm_eps)
    grads = reference_grads(
        reference_mamba3_scan_inputs, tensors, options, output_grads, autocast, _MAMBA3_PREPROCESSED
    )
    return _all_or_absent(grads, B)


@mamba3_scan_inputs_backward.register_fake
def _(dB_hat, dC_hat, ddt, dA, dlam, dangle, angle, B, C, dd_dt, dd_A, trap, angles, dt_bias, *rest):
    B_norm_weight, C_norm_weight, B_bias, C_bias, _, _, _, _, _, initial_angle, _ = rest
    return _grads_like(
        (B, C, dd_dt, dd_A, trap, angles, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, initial_angle)
    )


def _mamba3_inputs_setup(ctx, inputs, output):
    tensors, options = inputs[:11], inputs[11:15]
    seq_idx, initial_angle, autocast = inputs[15:]
    ctx.save_for_backward(output[5], *tensors, seq_idx, initial_angle)
    ctx.options = (*options, autocast)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None


def _mamba3_inputs_backward(ctx, *output_grads):
    angle, *tensors, seq_idx, initial_angle = ctx.saved_tensors
    A_floor, a_activation, rotation, norm_eps, autocast = ctx.options
    grads = mamba3_scan_inputs_backward(
        *output_grads, angle, *tensors, A_floor, a_activation, rotation, norm_eps, seq_idx, initial_angle, autocast
    )
    present = (*tensors, initial_angle)
    grads = [None if t is None else g for g, t in zip(grads, present)]
    return (*grads[:11], None, None, None, None, None, grads[11], None)


mamba3_scan_inputs.register_autograd(_mamba3_inputs_backward, setup_context=_mamba3_inputs_setup)


# ---- selective_scan -----------------------------------------------------------------------------

_SCAN_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


@torch.library.custom_op("megamamba::selective_scan", mutates_args=())
def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    delta_softplus: bool,
    return_last_state: bool,
    seq_idx: Optional[Tensor],
    initial_state: Optional[Tensor],
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, the last state; the placeholder unless return_last_state, Triton's chunk states for its
    backward; the placeholder on the reference). B and C as `_as_groups` gives them."""
    if backend(u) == "triton":
        out, last, chunk_states = triton("selective_scan").forward(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state
        )
    else:
        with autocast_to(u.device.type, autocast):
            out, last = reference_selective_scan(
                u, delta, A, B, C, D, z, delta_bias, delta_softplus, True, seq_idx, initial_state
            )
        out, last, chunk_states = out.contiguous(), last.contiguous(), _absent(u)
    return out, last if return_last_state else _absent(u), chunk_states


@selective_scan.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, seq_idx, initial_state, autocast):
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    chunk_states = _absent(u)
    if backend(u) == "triton":
        chunks = -(-seqlen // triton("selective_scan").CHUNK)
        chunk_states = u.new_empty((batch, chunks, dim, dstate), dtype=torch.float32)
    dtype = torch.float32 if backend(u) == "triton" else compute_dtype(u)
    last = u.new_empty((batch, dim, dstate), dtype=dtype) if return_last_state else _absent(u)
    return u.new_empty(u.shape), last, chunk_states


@torch.library.custom_op("megamamba::selective_scan_backward", mutates_args=())
def selective_scan_backward(
    dout: Tensor,
    dlast: Optional[Tensor],
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    delta_softplus: bool,
    seq_idx: Optional[Tensor],
    initial_state: Optional[Tensor],
    chunk_states: Tensor,
    autocast: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state) given dout and dlast (None: unused)."""
    if backend(u) == "triton":
        grads = triton("selective_scan").backward(
            dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state, chunk_states
        )
    else:
        tensors = dict(
            u=u,
            delta=delta,
            A=A,
            B=B,
            C=C,
            D=D,
            z=z,
            delta_bias=delta_bias,
            seq_idx=seq_idx,
            initial_state=initial_state,
        )
        options = dict(delta_softplus=delta_softplus, return_last_state=True)
        grads = reference_grads(reference_selective_scan, tensors, options, (dout, dlast), autocast, _SCAN_INPUTS)
    return _all_or_absent(grads, u)


@selective_scan_backward.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, initial_state, *rest):
    return _grads_like((u, delta, A, B, C, D, z, delta_bias, initial_state))


def _scan_setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, seq_idx, initial_state, autocast = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, seq_idx, initial_state, output[2])
    ctx.options = (delta_softplus, autocast)
    ctx.returns_last = return_last_state
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as the kernel expects


def _scan_backward(ctx, dout, dlast, _):
    u, delta, A, B, C, D, z, delta_bias, seq_idx, initial_state, chunk_states = ctx.saved_tensors
    delta_softplus, autocast = ctx.options
    dout = _zeros_like(u) if dout is None else dout  # only the last state is used
    grads = selective_scan_backward(
        dout,
        dlast if ctx.returns_last else None,
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        delta_softplus,
        seq_idx,
        initial_state,
        chunk_states,
        autocast,
    )
    present = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinit = (None if t is None else g for g, t in zip(grads, present))
    return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, None, None, None, dinit, None


selective_scan.register_autograd(_scan_backward, setup_context=_scan_setup)


# ---- single steps (generation: no gradients) ------------------------------------------------------


@torch.library.custom_op("megamamba::selective_state_update", mutates_args=("state",))
def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    dt_bias: Optional[Tensor],
    dt_softplus: bool,
) -> Tensor:
    return step.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


@selective_state_update.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    return x.new_empty(x.shape)


@torch.library.custom_op("megamamba::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]
) -> Tensor:
    return step.causal_conv1d_update(x, conv_state, weight, bias, activation)


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias, activation):
    return x.new_empty(x.shape)


# ---- FLOP formulas (arguments arrive as shapes) ---------------------------------------------------


def _ssd(x, B, chunk_size):
    batch, seqlen, nheads, headdim = x
    return flops.ssd_flops(batch * seqlen, seqlen, nheads, headdim, B[2], B[3], chunk_size)


def _scan(u, A):
    return flops.selective_scan_flops(u[0] * u[2], u[1], A[1])


def _mamba3(x, B, chunk_size):
    batch, seqlen, nheads, rank, headdim = x
    return flops.mamba3_scan_flops(batch * seqlen, seqlen, nheads, rank, headdim, B[-1], chunk_size)


def _conv(x, weight):
    return flops.conv_flops(x[0] * x[2], x[1], weight[1])


def _register_flops():
    ops = torch.ops.megamamba
    formulas: dict[Any, Callable[..., int]] = {
        ops.ssd_chunk_scan: lambda x, dt, A, B, C, chunk_size, *_, **__: _ssd(x, B, chunk_size),
        ops.ssd_chunk_scan_backward: lambda dy, df, x, dt, A, B, C, chunk_size, *_, **__: (
            flops.BACKWARD * _ssd(x, B, chunk_size)
        ),
        ops.selective_scan: lambda u, delta, A, *_, **__: _scan(u, A),
        ops.selective_scan_backward: lambda dout, dlast, u, delta, A, *_, **__: flops.BACKWARD * _scan(u, A),
        ops.mamba3_scan: lambda x, dt, A, lam, B, C, chunk_size, *_, **__: _mamba3(x, B, chunk_size),
        ops.mamba3_scan_backward: lambda dy, dssm, dlx, dlb, x, dt, A, lam, B, C, chunk_size, *_, **__: (
            flops.BACKWARD * _mamba3(x, B, chunk_size)
        ),
        ops.mamba3_scan_inputs: lambda *_, **__: 0,
        ops.mamba3_scan_inputs_backward: lambda *_, **__: 0,
        ops.causal_conv1d: lambda x, weight, *_, **__: _conv(x, weight),
        ops.causal_conv1d_backward: lambda dout, x, weight, *_, **__: flops.BACKWARD * _conv(x, weight),
        ops.rmsnorm_gated: lambda *_, **__: 0,
        ops.rmsnorm_gated_backward: lambda *_, **__: 0,
        ops.add_rmsnorm: lambda *_, **__: 0,
        ops.add_rmsnorm_backward: lambda *_, **__: 0,
        ops.selective_state_update: lambda state, *_, **__: flops.selective_scan_flops(
            state[0], state[1:-1].numel(), state[-1]
        ),
        ops.causal_conv1d_update: lambda x, conv_state, weight, *_, **__: flops.conv_flops(x[0], x[1], weight[1]),
    }
    for op, formula in formulas.items():
        register_flop_formula(op)(formula)


_register_flops()
