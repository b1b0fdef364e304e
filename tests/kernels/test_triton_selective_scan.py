"""Triton selective_scan (under TRITON_INTERPRET=1 on the CPU) against the float64 per-timestep
oracle: the output, the last state and the gradient of every float input within 1e-4 relative
in float32. seqlen 45 spans two checkpoint stretches (32 steps) and ends inside one."""
import pytest
import torch

import megamamba.kernels
import naive_ops
from megamamba.kernels.triton import common, selective_scan
from megamamba.kernels.triton.selective_scan import CHECKPOINT

pytestmark = pytest.mark.slow
TOL = 1e-4
BATCH, DIM, SEQLEN, DSTATE, GROUPS = 2, 12, 45, 5, 2


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every kernel-written buffer starts as NaN, so an unwritten element fails the check."""
    monkeypatch.setattr(common, "empty", lambda shape, *, device, dtype: torch.full(
        shape, float("nan"), device=device, dtype=dtype))


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def inputs(seed, *, b_shape=(BATCH, GROUPS, DSTATE, SEQLEN), c_shape=(BATCH, GROUPS, DSTATE, SEQLEN),
           extras=True, delta_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)
    t = dict(u=r(BATCH, DIM, SEQLEN), delta=delta_scale * r(BATCH, DIM, SEQLEN),
             A=-0.2 - torch.rand(DIM, DSTATE, generator=gen), B=r(*b_shape), C=r(*c_shape))
    if extras:
        t.update(D=r(DIM), z=r(BATCH, DIM, SEQLEN), delta_bias=r(DIM))
    return t


def documents():
    """Row 0: a boundary inside the first stretch, one exactly at the second stretch's start and
    the first id reused; row 1: one document."""
    assert CHECKPOINT == 32
    return torch.tensor([[3] * 10 + [1] * 22 + [3] * 13, [0] * SEQLEN], dtype=torch.int32)


def check_against_oracle(tensors, seed, **kwargs):
    """Triton on float32 copies vs the oracle on float64 copies: out, last state, all gradients."""
    ins32 = {k: v.detach().float().clone().requires_grad_() for k, v in tensors.items()}
    ins64 = {k: v.detach().double().clone().requires_grad_() for k, v in tensors.items()}
    out, last = selective_scan(**ins32, return_last_state=True, **kwargs)
    out_ref, last_ref = naive_ops.selective_scan(**ins64, return_last_state=True, **kwargs)
    for name, got, ref in (("out", out, out_ref), ("last_state", last, last_ref)):
        assert torch.isfinite(got).all(), f"seed {seed}: non-finite {name}"
        assert rel_err(got, ref) <= TOL, f"seed {seed}: {name} rel err {rel_err(got, ref):.2e}"
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out_ref.shape, generator=gen, dtype=torch.float64)
    dlast = torch.randn(last_ref.shape, generator=gen, dtype=torch.float64)
    ((out * dout.float()).sum() + (last * dlast.float()).sum()).backward()
    ((out_ref * dout).sum() + (last_ref * dlast).sum()).backward()
    for name, v in ins32.items():
        assert torch.isfinite(v.grad).all(), f"seed {seed}: non-finite grad of {name}"
        err = rel_err(v.grad, ins64[name].grad)
        assert err <= TOL, f"seed {seed}: grad of {name} rel err {err:.2e}"


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_selective_scan_grouped_matches_oracle(with_seq_idx):
    seed = 60 + with_seq_idx
    kwargs = dict(seq_idx=documents()) if with_seq_idx else {}
    check_against_oracle(inputs(seed), seed, delta_softplus=True, **kwargs)


def test_selective_scan_single_group_layout_without_extras_matches_oracle():
    """B, C (batch, dstate, seqlen); no D, z, delta_bias or softplus (positive raw delta)."""
    seed = 62
    t = inputs(seed, b_shape=(BATCH, DSTATE, SEQLEN), c_shape=(BATCH, DSTATE, SEQLEN), extras=False)
    t["delta"] = t["delta"].abs()
    check_against_oracle(t, seed)


def test_selective_scan_constant_B_matches_oracle():
    """B (dim, dstate) shared by all steps, C input-dependent with groups."""
    seed = 63
    check_against_oracle(inputs(seed, b_shape=(DIM, DSTATE)), seed, delta_softplus=True, seq_idx=documents())


def test_selective_scan_large_delta_stays_finite_and_exact():
    """delta up to ~1e3 after softplus: decays underflow to 0, nothing overflows or turns NaN."""
    seed = 64
    check_against_oracle(inputs(seed, delta_scale=300.0), seed, delta_softplus=True)


def test_public_api_runs_triton_when_forced(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(common, "document_counters", lambda *a: calls.append(a) or None)
    seed = 65
    t = inputs(seed)
    out = megamamba.kernels.selective_scan(**t, delta_softplus=True)
    ref = naive_ops.selective_scan(**{k: v.double() for k, v in t.items()}, delta_softplus=True)
    assert calls, "the Triton op was not called"
    assert rel_err(out, ref) <= TOL, f"seed {seed}: rel err {rel_err(out, ref):.2e}"
