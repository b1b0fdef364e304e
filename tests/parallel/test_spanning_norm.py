"""Mamba-2's gated RMSNorm + out_proj for norm groups spanning TP ranks, on one rank.

At TP 1 every collective is the identity, so these check the gating Function itself: float32
against float64 autograd on the same formula, bitwise equality under bf16 autocast with autograd
left to keep every float32 intermediate (the numerics the recomputing backward must not change),
and what it keeps for the backward. Across ranks, tests/parallel/test_tp_model.py compares the
model with the single-device one (ngroups 1 at TP 2 and 4, ngroups 2 at TP 4, with and without
sequence parallelism) and counts the collectives.
"""

import pytest
import torch
import torch.nn.functional as F

from megamamba.parallel import RowParallelLinear, TensorParallel
from megamamba.parallel.tensor.spanning_norm import gated_rmsnorm_row_parallel
from megamamba.testing.numerics import relative_error

SEED = 7
BATCH, SEQLEN, CHANNELS, D_MODEL = 2, 12, 64, 32
EPS = 1e-5


def _autograd_formula(y, z, norm_weight, out_weight, out_bias, norm_before_gate):
    """The norm and out_proj at TP 1 in plain torch ops, autograd keeping every intermediate."""
    ct = torch.promote_types(y.dtype, torch.float32)
    u, gate = y.to(ct), F.silu(z.to(ct))
    if not norm_before_gate:
        u = u * gate
    scaled = u * norm_weight.to(ct)
    if norm_before_gate:
        scaled = scaled * gate
    products = F.linear(scaled.to(y.dtype), out_weight)
    mean_square = u.pow(2).sum(-1, keepdim=True) / CHANNELS
    return products * torch.rsqrt(mean_square + EPS).to(products.dtype) + out_bias


def _inputs(dtype):
    gen = torch.Generator().manual_seed(SEED)
    y, z = (torch.randn(BATCH, SEQLEN, CHANNELS, generator=gen).to(dtype) for _ in range(2))
    norm_weight = 1 + 0.3 * torch.randn(CHANNELS, generator=gen)
    out_weight = torch.randn(D_MODEL, CHANNELS, generator=gen) / CHANNELS**0.5
    out_bias = torch.randn(D_MODEL, generator=gen)
    upstream = torch.randn(BATCH, SEQLEN, D_MODEL, generator=gen)
    return [t.requires_grad_() for t in (y, z, norm_weight, out_weight, out_bias)], upstream


def _spanning(y, z, norm_weight, out_weight, out_bias, norm_before_gate):
    out_proj = RowParallelLinear(CHANNELS, D_MODEL, TensorParallel())
    out_proj.weight, out_proj.bias = torch.nn.Parameter(out_weight), torch.nn.Parameter(out_bias)
    out = gated_rmsnorm_row_parallel(
        y, z, norm_weight, eps=EPS, group_size=CHANNELS, ngroups=1, norm_before_gate=norm_before_gate, out_proj=out_proj
    )
    return out, [y, z, norm_weight, out_proj.weight, out_proj.bias]


def _output_and_grads(fn, leaves, upstream, norm_before_gate, autocast):
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = fn(*leaves, norm_before_gate)
    out, leaves = out if isinstance(out, tuple) else (out, leaves)
    (out * upstream.to(out.dtype)).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_then_norm", "norm_then_gate"])
def test_output_and_gradients_equal_float64_autograd_in_float32(norm_before_gate):
    leaves, upstream = _inputs(torch.float32)
    got = _output_and_grads(_spanning, leaves, upstream, norm_before_gate, autocast=False)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _output_and_grads(_autograd_formula, ref_leaves, upstream.double(), norm_before_gate, autocast=False)
    for name, g, r in zip(["out", "y", "z", "norm weight", "out_proj weight", "out_proj bias"], got, ref):
        err = relative_error(g, r)
        assert err <= 1e-6, f"seed {SEED}: {name} off by {err:.2e}"


@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_then_norm", "norm_then_gate"])
def test_recomputing_backward_is_bitwise_autograd_under_bf16_autocast(norm_before_gate):
    leaves, upstream = _inputs(torch.bfloat16)
    got = _output_and_grads(_spanning, leaves, upstream, norm_before_gate, autocast=True)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref = _output_and_grads(_autograd_formula, ref_leaves, upstream, norm_before_gate, autocast=True)
    for name, g, r in zip(["out", "y", "z", "norm weight", "out_proj weight", "out_proj bias"], got, ref):
        assert g.dtype == r.dtype and torch.equal(g, r), f"seed {SEED}: {name} differs by {(g - r).abs().max()}"


@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_then_norm", "norm_then_gate"])
def test_keeps_no_float32_tensor_of_channel_width_under_bf16_autocast(norm_before_gate):
    """Only y and z (bf16), out_proj's bf16 input and output, and float32 scalars per token."""
    leaves, _ = _inputs(torch.bfloat16)
    params = {t.untyped_storage().data_ptr() for t in leaves[2:]}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            _spanning(*leaves, norm_before_gate)
    wide_float32 = [tuple(t.shape) for t in kept if t.dtype == torch.float32 and t.numel() > BATCH * SEQLEN]
    assert wide_float32 == [], f"float32 tensors kept for the backward: {wide_float32}"
    assert any(t is leaves[0] for t in kept) and any(t is leaves[1] for t in kept), "y and z kept as they came"
