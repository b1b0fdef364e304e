"""Triton selective_scan (under TRITON_INTERPRET=1 on the CPU) against the float64 per-timestep
oracle: the output, the last state and the gradient of every float input (initial state included)
within 1e-4 relative in float32. SEQLEN spans three chunks and ends inside a fourth; a group of
10 channels spans two channel blocks, the second one partly masked."""

import functools

import pytest
import torch

import megamamba.kernels
import naive_ops
import oracle_checks
from megamamba.kernels.triton import common, selective_scan
from megamamba.kernels.triton.selective_scan import BLOCK_D, CHUNK
from megamamba.testing.numerics import relative_error
from oracle_checks import TOL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
BATCH, DIM, DSTATE, GROUPS = 2, 20, 5, 2
SEQLEN = 3 * CHUNK + 13


def inputs(
    seed,
    *,
    b_shape=(BATCH, GROUPS, DSTATE, SEQLEN),
    c_shape=(BATCH, GROUPS, DSTATE, SEQLEN),
    extras=True,
    delta_scale=0.5,
    initial=False,
):
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    t = dict(
        u=r(BATCH, DIM, SEQLEN),
        delta=delta_scale * r(BATCH, DIM, SEQLEN),
        A=-0.2 - torch.rand(DIM, DSTATE, generator=gen),
        B=r(*b_shape),
        C=r(*c_shape),
    )
    if extras:
        t.update(D=r(DIM), z=r(BATCH, DIM, SEQLEN), delta_bias=r(DIM))
    if initial:
        t["initial_state"] = r(BATCH, DIM, DSTATE)
    return t


def documents():
    """Row 0: a boundary inside the first chunk, one exactly at the third chunk's start and the
    first id reused; row 1: one document."""
    first, second = 5, 2 * CHUNK - 5
    return torch.tensor([[3] * first + [1] * second + [3] * (SEQLEN - first - second), [0] * SEQLEN], dtype=torch.int32)


def check_against_oracle(tensors, seed, **kwargs):
    """Triton on float32 copies vs the oracle on float64 copies: out, last state, all gradients."""
    oracle_checks.check_against_oracle(
        selective_scan,
        naive_ops.selective_scan,
        tensors,
        seed,
        names=("out", "last_state"),
        return_last_state=True,
        **kwargs,
    )


def test_shapes_exercise_chunks_and_channel_blocks():
    assert SEQLEN % CHUNK and SEQLEN > 3 * CHUNK
    assert BLOCK_D < DIM // GROUPS < 2 * BLOCK_D
    starts = (documents()[0, 1:] != documents()[0, :-1]).nonzero().flatten() + 1
    assert starts.tolist() == [5, 2 * CHUNK]


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_selective_scan_grouped_matches_oracle(with_seq_idx):
    seed = 60 + with_seq_idx
    kwargs = dict(seq_idx=documents()) if with_seq_idx else {}
    check_against_oracle(inputs(seed), seed, delta_softplus=True, **kwargs)


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_selective_scan_initial_state_matches_oracle(with_seq_idx):
    """The initial state reaches only the first document; its gradient flows back through the chunks."""
    seed = 66 + with_seq_idx
    kwargs = dict(seq_idx=documents()) if with_seq_idx else {}
    check_against_oracle(inputs(seed, initial=True), seed, delta_softplus=True, **kwargs)


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


def test_selective_scan_constant_B_and_C_with_initial_state_matches_oracle():
    seed = 68
    check_against_oracle(
        inputs(seed, b_shape=(DIM, DSTATE), c_shape=(DIM, DSTATE), initial=True), seed, delta_softplus=True
    )


def test_selective_scan_large_delta_stays_finite_and_exact():
    """delta up to ~1e3 after softplus: decays underflow to 0, nothing overflows or turns NaN."""
    seed = 64
    check_against_oracle(inputs(seed, delta_scale=300.0, initial=True), seed, delta_softplus=True)


def test_public_api_runs_triton_when_forced(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(common, "document_counters", lambda *a: calls.append(a) or None)
    seed = 65
    t = inputs(seed, initial=True)
    out = megamamba.kernels.selective_scan(**t, delta_softplus=True)
    ref = naive_ops.selective_scan(**{k: v.double() for k, v in t.items()}, delta_softplus=True)
    assert calls, "the Triton op was not called"
    assert relative_error(out, ref) <= TOL, f"seed {seed}: rel err {relative_error(out, ref):.2e}"
