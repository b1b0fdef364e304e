"""The Mamba-3 reference scan, recurrent and chunked, against Mamba-3's equations written literally
(tests/mamba3_literal.py), in float64: SISO and MIMO, both rope fractions, both A activations, packed
documents and initial states."""

import pytest
import torch

from mamba3_literal import literal_scan
from megamamba.kernels.reference.mamba3 import ScanState, mamba3_scan_chunked, mamba3_scan_recurrent
from megamamba.kernels.reference.mamba3_inputs import mamba3_scan_inputs

TOL = 1e-6
BATCH, SEQLEN, NHEADS, NGROUPS, HEADDIM, DSTATE, CHUNK = 2, 13, 4, 2, 3, 8, 4
A_FLOOR = 1e-4


def rel_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ over the whole tensor; inf when anything is not finite."""
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def documents():
    """Row 0: documents start at 3 and 8 (a chunk edge); row 1: at 11, reusing the first id."""
    seq = torch.zeros(BATCH, SEQLEN, dtype=torch.int32)
    seq[0, 3:], seq[0, 8:] = 1, 2
    seq[1, 11:] = 0
    seq[1, :11] = 5
    return seq


def case(seed, rank, rope_fraction):
    """Raw in_proj columns, the mixer's weights (non-trivial norms and biases) and an initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    nangles = int(DSTATE * rope_fraction) // 2
    raw = dict(
        x=randn(BATCH, SEQLEN, NHEADS, rank, HEADDIM),
        B=randn(BATCH, SEQLEN, rank, NGROUPS, DSTATE),
        C=randn(BATCH, SEQLEN, rank, NGROUPS, DSTATE),
        dd_dt=randn(BATCH, SEQLEN, NHEADS),
        dd_A=randn(BATCH, SEQLEN, NHEADS),
        trap=randn(BATCH, SEQLEN, NHEADS),
        angles=randn(BATCH, SEQLEN, nangles),
    )
    weights = dict(
        dt_bias=randn(NHEADS),
        B_norm=1 + randn(DSTATE) / 2,
        C_norm=1 + randn(DSTATE) / 2,
        B_bias=randn(NHEADS, rank, DSTATE),
        C_bias=randn(NHEADS, rank, DSTATE),
        D=randn(NHEADS),
    )
    initial = (
        randn(BATCH, NHEADS, nangles),
        randn(BATCH, NHEADS, HEADDIM, DSTATE),
        randn(BATCH, NHEADS, rank, HEADDIM),
        randn(BATCH, NHEADS, rank, DSTATE),
    )
    return raw, weights, initial


def ours(raw, w, *, rank, activation, chunk_size=None, seq_idx=None, initial=None):
    """Preprocessing then the scan (chunked with a chunk size, else recurrent): y and (angle, ssm, x, B̂)."""
    inputs = mamba3_scan_inputs(
        raw["B"],
        raw["C"],
        raw["dd_dt"],
        raw["dd_A"],
        raw["trap"],
        raw["angles"],
        w["dt_bias"],
        w["B_norm"],
        w["C_norm"],
        w["B_bias"],
        w["C_bias"],
        A_FLOOR,
        a_activation=activation,
        rotation="halves" if rank > 1 else "adjacent",
        seq_idx=seq_idx,
        initial_angle=None if initial is None else initial[0],
    )
    scan_args = (raw["x"], inputs.dt, inputs.A, inputs.lam, inputs.B, inputs.C)
    state = None if initial is None else ScanState(*initial[1:])
    common = dict(D=w["D"], initial_state=state, seq_idx=seq_idx, return_final_state=True)
    if chunk_size is None:
        y, final = mamba3_scan_recurrent(*scan_args, **common)
    else:
        y, final = mamba3_scan_chunked(*scan_args, chunk_size, **common)
    return y, (inputs.angle[:, -1], *final)


def literal(raw, w, *, rank, activation, seq_idx=None, initial=None):
    return literal_scan(
        raw["x"],
        raw["B"],
        raw["C"],
        raw["dd_dt"],
        raw["dd_A"],
        raw["trap"],
        raw["angles"],
        w,
        mimo=rank > 1,
        activation=activation,
        A_floor=A_FLOOR,
        seq_idx=seq_idx,
        initial=initial,
    )


def assert_close(seed, got, want, what):
    (y, state), (y_ref, state_ref) = got, want
    err = rel_error(y, y_ref)
    assert err <= TOL, f"seed {seed}: {what}: y rel err {err:.2e}"
    for name, a, b in zip(("angle", "ssm", "x", "B"), state, state_ref):
        err = rel_error(a, b)
        assert err <= TOL, f"seed {seed}: {what}: final {name} rel err {err:.2e}"


@pytest.mark.parametrize("activation", ["heavy_tail", "softplus"])
@pytest.mark.parametrize("rope_fraction", [0.5, 1.0])
@pytest.mark.parametrize("rank", [1, 2])
def test_both_forms_equal_the_literal_equations_with_documents_and_initial_state(rank, rope_fraction, activation):
    seed = 100 + 10 * rank + int(4 * rope_fraction) + (activation == "softplus")
    raw, w, initial = case(seed, rank, rope_fraction)
    kw = dict(rank=rank, activation=activation, seq_idx=documents(), initial=initial)
    want = literal(raw, w, **kw)
    assert_close(seed, ours(raw, w, **kw), want, "recurrent")
    assert_close(seed, ours(raw, w, chunk_size=CHUNK, **kw), want, f"chunked ({CHUNK})")


@pytest.mark.parametrize("chunk_size", [1, 5, SEQLEN, 16])
def test_chunked_form_equals_literal_equations_at_any_chunk_size(chunk_size):
    seed = 200 + chunk_size
    raw, w, _ = case(seed, 2, 0.5)
    want = literal(raw, w, rank=2, activation="heavy_tail")
    assert_close(seed, ours(raw, w, rank=2, activation="heavy_tail", chunk_size=chunk_size), want, "chunked")


@pytest.mark.parametrize("rank", [1, 2])
def test_final_state_continues_the_sequence(rank):
    """Two halves, the second started from the first's final state (angle, ssm, previous x and B̂),
    give the whole sequence's output and final state."""
    seed, cut = 300 + rank, 6
    raw, w, _ = case(seed, rank, 1.0)
    first = {k: v[:, :cut] for k, v in raw.items()}
    second = {k: v[:, cut:] for k, v in raw.items()}
    whole = ours(raw, w, rank=rank, activation="heavy_tail", chunk_size=CHUNK)
    y1, state = ours(first, w, rank=rank, activation="heavy_tail", chunk_size=CHUNK)
    y2, final = ours(second, w, rank=rank, activation="heavy_tail", chunk_size=CHUNK, initial=state)
    assert_close(seed, (torch.cat([y1, y2], dim=1), final), whole, "continued")


def test_relative_error_never_passes_nan():
    ref = torch.ones(3, dtype=torch.float64)
    assert not rel_error(torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64), ref) <= TOL


@pytest.mark.parametrize("rank", [1, 2])
def test_chunked_gradients_equal_recurrent_gradients(rank):
    """Every input's gradient (raw columns, weights, initial state) through the chunked form equals the
    recurrent form's, with documents and an initial state: the chunked form's masks leave no NaN behind."""
    seed = 400 + rank
    raw, w, initial = case(seed, rank, 0.5)
    leaves = [*raw.values(), *w.values(), *initial]
    gen = torch.Generator().manual_seed(seed + 1)
    grads = []
    for chunk_size in (None, CHUNK):
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        y, state = ours(
            raw, w, rank=rank, activation="heavy_tail", chunk_size=chunk_size, seq_idx=documents(), initial=initial
        )
        outputs = (y, *state[1:])
        gen.manual_seed(seed + 1)
        torch.autograd.backward(outputs, [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outputs])
        grads.append([t.grad.clone() for t in leaves])
    for i, (chunked, recurrent) in enumerate(zip(grads[1], grads[0])):
        err = rel_error(chunked, recurrent)
        assert err <= TOL, f"seed {seed}: gradient of input {i} rel err {err:.2e}"
