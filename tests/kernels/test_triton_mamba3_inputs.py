"""Triton Mamba-3 preprocessing (the `mamba3_scan_inputs` op forced to Triton, TRITON_INTERPRET=1 on the CPU)
against the float64 reference: B̂, Ĉ, Δ, A, λ and the angle (compared as its cosine and sine: it is defined
modulo 2π), and the gradient of every input, within 1e-4 in float32. Lengths end inside the third block of
tokens; SISO rotates adjacent pairs with documents and an initial angle, MIMO (rank 3, two B/C groups of two
heads) rotates halves with every state dimension rotated. bf16 raw columns stay within 1.5 times the
reference's error on the same inputs. opcheck runs the op and its backward op in tests/kernels/op_cases.py."""

import functools

import pytest
import torch

import oracle_checks
from bf16_checks import assert_within_theirs, errors_of
from megamamba.kernels import mamba3_scan_inputs
from megamamba.kernels.reference import mamba3_inputs as reference
from megamamba.kernels.triton import mamba3_inputs as triton_inputs
from triton_calls import triton_forward_and_backward_run

pytestmark = pytest.mark.usefixtures("poisoned_buffers", "triton_backend")
BATCH, SEQLEN, DSTATE = 2, 37, 16
NAMES = ("B", "C", "dt", "A", "lam", "cos", "sin")
SISO = dict(rank=1, ngroups=1, nheads=3, nangles=4, rotation="adjacent", a_activation="heavy_tail", A_floor=1e-4)
MIMO = dict(rank=3, ngroups=2, nheads=4, nangles=8, rotation="halves", a_activation="softplus", A_floor=0.5)


@pytest.fixture
def triton_backend(monkeypatch):
    """The op runs Triton on CPU tensors; the test fails unless Triton's forward and backward really ran."""
    with triton_forward_and_backward_run(monkeypatch, triton_inputs, "Mamba-3 preprocessing"):
        yield


def inputs(seed, rank, ngroups, nheads, nangles, initial_angle, raw_dtype=torch.float32, **_):
    """in_proj's raw columns (in `raw_dtype`) at the mixer's scale, the float32 parameters away from their
    initial values (norm weights and biases not 1), dd_A spread over both sides of 0."""
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)

    def raw(*shape, scale=1.0):
        return (scale * r(*shape)).to(raw_dtype)

    t = dict(
        B=raw(BATCH, SEQLEN, rank, ngroups, DSTATE),
        C=raw(BATCH, SEQLEN, rank, ngroups, DSTATE),
        dd_dt=raw(BATCH, SEQLEN, nheads),
        dd_A=raw(BATCH, SEQLEN, nheads, scale=2.0),
        trap=raw(BATCH, SEQLEN, nheads),
        angles=raw(BATCH, SEQLEN, nangles),
        dt_bias=0.5 * r(nheads),
        B_norm_weight=1 + 0.3 * r(DSTATE),
        C_norm_weight=1 + 0.3 * r(DSTATE),
        B_bias=1 + 0.3 * r(nheads, rank, DSTATE),
        C_bias=1 + 0.3 * r(nheads, rank, DSTATE),
    )
    if initial_angle:
        t["initial_angle"] = r(BATCH, nheads, nangles)
    return t


def documents():
    """Row 0: documents start inside block 0, exactly at block 2's start and one token before the end, the
    first id reused; row 1: one document."""
    row0 = [4] * 9 + [1] * 23 + [2] * 4 + [4]
    return torch.tensor([row0, [0] * SEQLEN], dtype=torch.int32)


def as_compared(fn, *, A_floor, a_activation, rotation, seq_idx=None, **tensors):
    """fn's outputs with the angle as its cosine and sine."""
    out = fn(**tensors, A_floor=A_floor, a_activation=a_activation, rotation=rotation, seq_idx=seq_idx)
    return (*out[:5], torch.cos(out.angle), torch.sin(out.angle))


ours = functools.partial(as_compared, mamba3_scan_inputs)
exact = functools.partial(as_compared, reference.mamba3_scan_inputs)


@pytest.mark.parametrize("case", [SISO, MIMO], ids=["siso", "mimo"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_mamba3_scan_inputs_match_float64_reference(case, with_documents):
    seed = 110 + 2 * (case is MIMO) + with_documents
    options = {k: case[k] for k in ("A_floor", "a_activation", "rotation")}
    if with_documents:
        options["seq_idx"] = documents()
    tensors = inputs(seed, **case, initial_angle=case is SISO)
    oracle_checks.check_against_oracle(ours, exact, tensors, seed, names=NAMES, **options)


@pytest.mark.parametrize("case", [SISO, MIMO], ids=["siso", "mimo"])
def test_bf16_mamba3_scan_inputs_within_reference_on_the_same_inputs(case):
    """bf16 in_proj columns, float32 parameters, as the mixer under bf16 autocast has them."""
    seed = 120 + (case is MIMO)
    tensors = inputs(seed, **case, initial_angle=True, raw_dtype=torch.bfloat16)
    options = {k: case[k] for k in ("A_floor", "a_activation", "rotation")}
    found = errors_of(
        {"ours": ours, "theirs": exact}, exact, tensors, seed, names=NAMES, **options, seq_idx=documents()
    )
    assert_within_theirs(found["ours"], found["theirs"], seed)
