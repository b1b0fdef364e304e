"""Triton ssd_chunk_scan (under TRITON_INTERPRET=1 on the CPU) against the float64 per-timestep
oracle: the output, the final state and the gradient of every float input within 1e-4 relative
in float32, for seqlen not a multiple of the chunk and ngroups > 1."""

import functools

import pytest
import torch

import megamamba.kernels
import naive_ops
import oracle_checks
from megamamba.kernels.triton import common, ssd_chunk_scan
from megamamba.testing.numerics import relative_error
from oracle_checks import TOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
BATCH, SEQLEN, NHEADS, HEADDIM, NGROUPS, DSTATE, CHUNK = 2, 37, 4, 8, 2, 16, 16


def inputs(seed, *, d_shape=(NHEADS,), z=True, dt_bias=True, initial_states=False, dt_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    t = dict(
        x=r(BATCH, SEQLEN, NHEADS, HEADDIM),
        dt=dt_scale * r(BATCH, SEQLEN, NHEADS),
        A=-0.5 - torch.rand(NHEADS, generator=gen),
        B=r(BATCH, SEQLEN, NGROUPS, DSTATE),
        C=r(BATCH, SEQLEN, NGROUPS, DSTATE),
        D=r(*d_shape),
    )
    if z:
        t["z"] = r(BATCH, SEQLEN, NHEADS, HEADDIM)
    if dt_bias:
        t["dt_bias"] = r(NHEADS)
    if initial_states:
        t["initial_states"] = r(BATCH, NHEADS, HEADDIM, DSTATE)
    return t


def documents():
    """Row 0: boundaries inside chunks 0 and 1 and one exactly at chunk 2's start, the first id
    reused for the last document; row 1: one document."""
    row0 = [5] * 10 + [1] * 22 + [5] * 5
    return torch.tensor([row0, [0] * SEQLEN], dtype=torch.int32)


def check_against_oracle(fn, tensors, seed, tol_by_grad=None, **kwargs):
    """fn on float32 copies vs the oracle on float64 copies: y, final state and all gradients
    (within TOL, or tol_by_grad[name] for the named ones)."""
    oracle_checks.check_against_oracle(
        fn,
        naive_ops.ssd_chunk_scan,
        tensors,
        seed,
        names=("y", "final_states"),
        tol_by_grad=tol_by_grad,
        chunk_size=CHUNK,
        return_final_states=True,
        **kwargs,
    )


@pytest.mark.parametrize("with_initial_states", [False, True])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_ssd_chunk_scan_matches_oracle(with_initial_states, with_seq_idx):
    seed = 10 + 2 * with_initial_states + with_seq_idx
    kwargs = dict(seq_idx=documents()) if with_seq_idx else {}
    check_against_oracle(
        ssd_chunk_scan, inputs(seed, initial_states=with_initial_states), seed, dt_softplus=True, **kwargs
    )


def test_ssd_chunk_scan_per_channel_D_dt_limit_without_softplus_matches_oracle():
    """D (nheads, headdim), no gate, raw dt clamped to (0.05, 1.5): clamped steps get no gradient."""
    seed = 20
    t = inputs(seed, d_shape=(NHEADS, HEADDIM), z=False, initial_states=True)
    t["dt"] = t["dt"].abs()
    check_against_oracle(ssd_chunk_scan, t, seed, dt_limit=(0.05, 1.5))


def test_ssd_chunk_scan_large_dt_keeps_every_gradient_accurate():
    """dt up to ~1e3 after softplus: decays underflow to 0 instead of overflowing, and every
    gradient, dA and d dt_bias included, stays within 1e-4. float32 within-chunk cumulative sums
    of dt*A reach ~1e4 here; the log-decay gradient sums only the pairs of positions a step
    separates, so no cancellation amplifies their rounding (measured: dA 2.8e-5, d dt_bias 3.8e-6).
    """
    seed = 30
    check_against_oracle(
        ssd_chunk_scan, inputs(seed, dt_scale=300.0, initial_states=True), seed, dt_softplus=True, seq_idx=documents()
    )


def test_ssd_chunk_scan_moderately_large_dt_keeps_dA_accurate():
    """dt up to ~10: every gradient, dA included, within 1e-4."""
    seed = 31
    check_against_oracle(ssd_chunk_scan, inputs(seed, dt_scale=5.0), seed, dt_softplus=True, seq_idx=documents())


def test_ssd_chunk_scan_reads_strided_views():
    """x, z, B, C, dt as column slices of one packed projection, as the Mamba-2 mixer passes
    them: output and gradients (which come back contiguous) still match."""
    seed = 40
    gen = torch.Generator().manual_seed(seed)
    d_inner, d_bc = NHEADS * HEADDIM, NGROUPS * DSTATE
    shape4, shape_bc = (BATCH, SEQLEN, NHEADS, HEADDIM), (BATCH, SEQLEN, NGROUPS, DSTATE)

    def run(dtype):
        packed = torch.randn(BATCH, SEQLEN, 2 * d_inner + 2 * d_bc + NHEADS, generator=gen.manual_seed(seed))
        packed = packed.to(dtype).requires_grad_()
        z, x, B, C, dt = torch.split(packed, [d_inner, d_inner, d_bc, d_bc, NHEADS], dim=-1)
        A = -torch.linspace(0.5, 1.5, NHEADS, dtype=dtype)
        fn = ssd_chunk_scan if dtype == torch.float32 else naive_ops.ssd_chunk_scan
        y = fn(
            x.view(shape4),
            dt,
            A,
            B.view(shape_bc),
            C.view(shape_bc),
            CHUNK,
            D=torch.ones(NHEADS, dtype=dtype),
            z=z.view(shape4),
            dt_softplus=True,
        )
        y.backward(torch.randn(y.shape, generator=gen.manual_seed(seed + 1)).to(dtype))
        return y, packed.grad

    (y, grad), (y_ref, grad_ref) = run(torch.float32), run(torch.float64)
    assert relative_error(y, y_ref) <= TOL, f"seed {seed}: rel err {relative_error(y, y_ref):.2e}"
    assert relative_error(grad, grad_ref) <= TOL, f"seed {seed}: grad rel err {relative_error(grad, grad_ref):.2e}"


def test_public_api_runs_triton_when_forced(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(common, "document_counters", lambda *a: calls.append(a) or None)
    seed = 50
    t = inputs(seed)
    y = megamamba.kernels.ssd_chunk_scan(chunk_size=CHUNK, dt_softplus=True, **t)
    ref = naive_ops.ssd_chunk_scan(**{k: v.double() for k, v in t.items()}, chunk_size=CHUNK, dt_softplus=True)
    assert calls, "the Triton op was not called"
    assert relative_error(y, ref) <= TOL, f"seed {seed}: rel err {relative_error(y, ref):.2e}"
