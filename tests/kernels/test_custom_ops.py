"""The kernels as custom ops (megamamba/kernels/api/ops.py), on the reference: torch.library.opcheck passes
for every op and its backward op (schema, fake tensors' shapes, strides and dtypes, autograd, AOT dispatch),
on compact inputs and on the sliced and transposed views the mixers hand them; FlopCounterMode counts each
op by its formula; the gradients are the reference's own, under autocast too, with unused outputs and
absent inputs changing nothing."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import megamamba.kernels as kernels
from megamamba.kernels import flops, ops
from megamamba.kernels.reference.add_norm import add_rmsnorm as reference_add_rmsnorm
from megamamba.kernels.reference.ssd import ssd_chunk_scan as reference_ssd_chunk_scan
from op_cases import BATCH, SEQLEN, backward_cases, documents, leaf, op_cases


@pytest.mark.parametrize("views", [False, True])
def test_every_op_passes_opcheck(views):
    seed = 11 + views
    for name, (op, args) in op_cases(torch.Generator().manual_seed(seed), views).items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: {name} {results}"


def test_every_backward_op_passes_opcheck():
    seed = 13
    for name, (op, args) in backward_cases(torch.Generator().manual_seed(seed)).items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: {name} {results}"


def counted(fn):
    """{op name: FLOPs} FlopCounterMode books while fn runs (its forward and backward)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}


def test_ssd_flops_equal_the_matmuls_of_the_dense_chunked_algorithm():
    b, L, h, p, g, n, q = 2, 64, 4, 8, 2, 16, 16
    c = L // q
    x = torch.randn(b, c, q, g, h // g, p)
    B, C = torch.randn(b, c, q, g, n), torch.randn(b, c, q, g, n)
    with FlopCounterMode(display=False) as counter:
        cb = torch.einsum("bclgn,bcsgn->bcgls", C, B)
        torch.einsum("bcgls,bcsgrp->bclgrp", cb, x)
        states = torch.einsum("bcsgrp,bcsgn->bcgrpn", x, B)
        torch.einsum("bclgn,bcgrpn->bclgrp", C, states)
    assert flops.ssd_flops(b * L, L, h, p, g, n, q) == counter.get_total_flops()


def test_the_flop_counter_counts_each_op_by_its_formula():
    seed = 17
    gen = torch.Generator().manual_seed(seed)
    b, L, h, p, g, n, d = BATCH, SEQLEN, 4, 3, 2, 5, 6
    x, dt, B, C = (leaf(torch.randn(*s, generator=gen)) for s in ((b, L, h, p), (b, L, h), (b, L, g, n), (b, L, g, n)))
    A = leaf(-torch.rand(h, generator=gen))
    ssd = flops.ssd_flops(b * L, L, h, p, g, n, 4)
    assert counted(lambda: kernels.ssd_chunk_scan(x, dt, A, B, C, 4).sum().backward()) == {
        "megamamba.ssd_chunk_scan": ssd,
        "megamamba.ssd_chunk_scan_backward": 2 * ssd,
    }

    u, delta, Bs, Cs = (leaf(torch.randn(*s, generator=gen)) for s in ((b, d, L), (b, d, L), (b, n, L), (b, n, L)))
    As = leaf(-torch.rand(d, n, generator=gen))
    scan = flops.selective_scan_flops(b * L, d, n)
    assert scan == 9 * b * L * d * n
    assert counted(lambda: kernels.selective_scan(u, delta, As, Bs, Cs).sum().backward()) == {
        "megamamba.selective_scan": scan,
        "megamamba.selective_scan_backward": 2 * scan,
    }

    w = leaf(torch.randn(d, 3, generator=gen))
    conv = flops.conv_flops(b * L, d, 3)
    assert conv == 2 * b * L * d * 3
    assert counted(lambda: kernels.causal_conv1d(u, w, activation="silu").sum().backward()) == {
        "megamamba.causal_conv1d": conv,
        "megamamba.causal_conv1d_backward": 2 * conv,
    }

    norm_w = leaf(torch.ones(L, dtype=torch.float32))
    assert counted(lambda: kernels.rmsnorm_gated(u, norm_w).sum().backward()) == {
        "megamamba.rmsnorm_gated": 0,
        "megamamba.rmsnorm_gated_backward": 0,
    }
    assert counted(lambda: kernels.add_rmsnorm(u, u, norm_w)[0].sum().backward()) == {
        "megamamba.add_rmsnorm": 0,
        "megamamba.add_rmsnorm_backward": 0,
    }

    state, conv_state = torch.zeros(b, d, n), torch.zeros(b, d, 3)
    step = counted(
        lambda: (
            kernels.selective_state_update(
                state, u[..., 0].detach(), delta[..., 0].detach(), As.detach(), Bs[..., 0].detach(), Cs[..., 0].detach()
            ),
            kernels.causal_conv1d_update(u[..., 0].detach(), conv_state, w.detach()),
        )
    )
    assert step == {
        "megamamba.selective_state_update": flops.selective_scan_flops(b, d, n),
        "megamamba.causal_conv1d_update": flops.conv_flops(b, d, 3),
    }


def ssd_inputs(gen, dtype=torch.float32):
    b, L, h, p, g, n = BATCH, SEQLEN, 4, 3, 2, 5
    tensors = dict(
        x=torch.randn(b, L, h, p, generator=gen),
        dt=torch.randn(b, L, h, generator=gen),
        A=-torch.rand(h, generator=gen),
        B=torch.randn(b, L, g, n, generator=gen),
        C=torch.randn(b, L, g, n, generator=gen),
        D=torch.randn(h, generator=gen),
        z=torch.randn(b, L, h, p, generator=gen),
        dt_bias=torch.randn(h, generator=gen),
        initial_states=torch.randn(b, h, p, n, generator=gen),
    )
    return {k: leaf(v.to(dtype) if k in ("x", "z", "B", "C") else v) for k, v in tensors.items()}


def grads(fn, tensors, loss, **options):
    """(outputs, {name: gradient}) of loss(fn(**tensors, **options))."""
    leaves = {k: leaf(v) for k, v in tensors.items()}
    out = fn(**leaves, **options)
    loss(out).backward()
    return out, {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("autocast", [False, True])
def test_the_ssd_gradients_are_the_references_own_under_autocast_too(autocast):
    """The op's backward recomputes the reference under the forward's autocast: bit for bit what autograd
    through the reference gives (bf16 autocast: its einsums in bf16)."""
    seed = 19 + autocast
    tensors = ssd_inputs(torch.Generator().manual_seed(seed))
    g = torch.randn(BATCH, SEQLEN, 4, 3, generator=torch.Generator().manual_seed(seed + 100))
    found = {}
    for name, fn in (("op", kernels.ssd_chunk_scan), ("reference", reference_ssd_chunk_scan)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            found[name] = grads(
                fn, tensors, lambda y: (y.float() * g).sum(), chunk_size=4, seq_idx=documents(), dt_softplus=True
            )
    (y_op, g_op), (y_ref, g_ref) = found["op"], found["reference"]
    assert torch.equal(y_op, y_ref), f"seed {seed}"
    for name in tensors:
        assert torch.equal(g_op[name], g_ref[name]), f"seed {seed}: grad of {name}"


def test_unused_final_states_change_no_gradient():
    """Unused outputs reach the backward as None, as the kernels expect: asking for the final states and
    leaving them unused gives the gradients of not asking."""
    seed = 23
    tensors = ssd_inputs(torch.Generator().manual_seed(seed))
    _, asked = grads(
        kernels.ssd_chunk_scan, tensors, lambda out: out[0].square().sum(), chunk_size=4, return_final_states=True
    )
    _, plain = grads(kernels.ssd_chunk_scan, tensors, lambda y: y.square().sum(), chunk_size=4)
    for name in tensors:
        assert torch.equal(asked[name], plain[name]), f"seed {seed}: grad of {name}"


@pytest.mark.parametrize("residual_dtype", [None, torch.float64])
def test_add_rmsnorm_gradients_through_either_output_are_the_references(residual_dtype):
    """Through the norm alone, the new residual alone and both: the reference's gradients; without a residual
    the new residual is x itself, as before."""
    seed = 29
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        x=torch.randn(BATCH, SEQLEN, 7, generator=gen),
        residual=torch.randn(BATCH, SEQLEN, 7, generator=gen),
        weight=torch.randn(7, generator=gen),
    )
    losses = {
        "norm": lambda out: out[0].sum(),
        "residual": lambda out: out[1].square().sum(),
        "both": lambda out: out[0].sum() + out[1].square().sum(),
    }
    for which, loss in losses.items():
        _, ours = grads(kernels.add_rmsnorm, tensors, loss, residual_dtype=residual_dtype)
        _, ref = grads(reference_add_rmsnorm, tensors, loss, residual_dtype=residual_dtype)
        for name in tensors:  # an input the used outputs do not reach: zeros, as on Triton (autograd: None)
            expected = torch.zeros_like(tensors[name]) if ref[name] is None else ref[name]
            assert torch.equal(ours[name], expected), f"seed {seed}: {which}: grad of {name}"
    x, weight = leaf(tensors["x"]), leaf(tensors["weight"])
    normed, r = kernels.add_rmsnorm(x, None, weight)
    assert r is x
    normed.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_absent_inputs_get_no_gradient_and_the_document_ids_none():
    seed = 31
    gen = torch.Generator().manual_seed(seed)
    x = leaf(torch.randn(BATCH, 6, SEQLEN, generator=gen))
    weight = leaf(torch.randn(6, 4, generator=gen))
    out = ops.causal_conv1d(x, weight, None, documents(), None, None)
    grad_fn = out.grad_fn
    received = grad_fn.apply(torch.ones_like(out))
    assert received[0] is not None and received[1] is not None, f"seed {seed}"
    assert all(g is None for g in received[2:]), f"seed {seed}: {[type(g) for g in received]}"
