"""Public ops: each picks the Triton kernel or the PyTorch reference at call time.

MEGAMAMBA_KERNELS chooses: "triton" forces Triton (on CPU tensors it needs
TRITON_INTERPRET=1), "reference" forces PyTorch, unset / "" / "auto" uses Triton for CUDA
tensors and the reference otherwise. Each call costs one lookup of the variable (so tests and
users can switch it at run time); its parsing is cached per value. Triton ops live in
`megamamba.kernels.triton` under the same name and signature; that module is imported once,
when first chosen. The single-step ops always use the reference.
"""
import importlib
import os

from .reference import step
from .reference.add_norm import add_rmsnorm as reference_add_rmsnorm
from .reference.conv import causal_conv1d as reference_causal_conv1d
from .reference.norm import rmsnorm_gated as reference_rmsnorm_gated
from .reference.selective_scan import selective_scan as reference_selective_scan
from .reference.ssd import ssd_chunk_scan as reference_ssd_chunk_scan

BACKENDS = ("auto", "reference", "triton")
ENV = "MEGAMAMBA_KERNELS"


_CHOICES = {}    # raw value of ENV -> parsed choice
_TRITON = None   # megamamba.kernels.triton, once imported


def _choice(raw) -> str:
    choice = (raw or "").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV}={raw!r} is not one of {', '.join(BACKENDS)}")
    _CHOICES[raw] = choice
    return choice


def backend(device_tensor) -> str:
    """"triton" or "reference" for an op whose main input is `device_tensor`, as the env asks."""
    raw = os.environ.get(ENV)
    choice = _CHOICES.get(raw) or _choice(raw)
    if choice == "auto":
        return "triton" if device_tensor.is_cuda else "reference"
    return choice


def _pick(name, reference_fn, device_tensor):
    global _TRITON
    if backend(device_tensor) == "reference":
        return reference_fn
    if _TRITON is None:
        _TRITON = importlib.import_module("megamamba.kernels.triton")
    fn = getattr(_TRITON, name, None)
    if fn is None:
        raise NotImplementedError(f"megamamba.kernels.triton has no {name}; set {ENV}=reference to use PyTorch")
    return fn


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, seq_idx=None, initial_state=None):
    """Mamba-1 selective scan, as mamba_ssm's selective_scan_fn.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (batch, groups, dstate, seqlen),
    (batch, dstate, seqlen) or (dim, dstate); D, delta_bias: (dim,). delta -> delta + delta_bias ->
    softplus if delta_softplus. out = y (+ D*u) (* silu(z)), (batch, dim, seqlen) in u's dtype,
    and last_state (batch, dim, dstate) when return_last_state. seq_idx (batch, seqlen) int: the
    state restarts from zero wherever the document id changes. initial_state (batch, dim, dstate):
    the state before the first step (it reaches only the first document); differentiable.
    """
    fn = _pick("selective_scan", reference_selective_scan, u)
    return fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
              return_last_state=return_last_state, seq_idx=seq_idx, initial_state=initial_state)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """Mamba-2 SSD scan, as mamba_ssm's mamba_chunk_scan_combined.

    x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A, dt_bias: (nheads,);
    B, C: (batch, seqlen, ngroups, dstate); D: (nheads,) or (nheads, headdim); initial_states:
    (batch, nheads, headdim, dstate). dt -> dt + dt_bias -> softplus if dt_softplus -> clamp to
    dt_limit. y = scan (+ D*x) (* silu(z)) in x's dtype [, final_states]. seq_idx (batch, seqlen)
    int: the state restarts where the id changes; initial_states reach only the first document.
    """
    fn = _pick("ssd_chunk_scan", reference_ssd_chunk_scan, x)
    return fn(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
              seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
              return_final_states=return_final_states)


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """Depthwise causal conv: x (batch, dim, seqlen), weight (dim, width), bias (dim,).

    activation None, "silu" or "swish"; with seq_idx no tap crosses a document boundary.
    """
    fn = _pick("causal_conv1d", reference_causal_conv1d, x)
    return fn(x, weight, bias=bias, seq_idx=seq_idx, activation=activation)


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm over groups of group_size channels of the last dim, as mamba_ssm's rmsnorm_fn."""
    fn = _pick("rmsnorm_gated", reference_rmsnorm_gated, x)
    return fn(x, weight, bias=bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


def add_rmsnorm(x, residual, weight, eps=1e-6, residual_dtype=None):
    """Pre-norm of a block: r = x + residual (x when residual is None); returns (rmsnorm(r) * weight in
    weight's dtype, computed on r cast to it; r in residual_dtype, default its own), as mamba_ssm's
    fused add + RMSNorm."""
    fn = _pick("add_rmsnorm", reference_add_rmsnorm, x)
    return fn(x, residual, weight, eps=eps, residual_dtype=residual_dtype)


selective_state_update = step.selective_state_update
causal_conv1d_update = step.causal_conv1d_update
