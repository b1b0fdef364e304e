"""Triton Mamba-3 scan, SISO and MIMO (the `mamba3_scan` op forced to Triton, TRITON_INTERPRET=1 on the
CPU) against the float64 recurrent reference: the output, the final state and the gradient of every float
input within 1e-4 in float32, with a length that ends inside the third chunk, packed documents and an
initial state; in bf16, every error at most 1.5 times the reference's own computed under bf16 autocast.
MIMO runs at rank 3, so its SSD chunks (3 x 16 steps) are not a power of two.
The op and its backward op pass opcheck, and the FLOP counter counts the op by its formula."""

import functools

import pytest
import torch

import megamamba.kernels
import oracle_checks
from bf16_checks import assert_within_theirs, errors_of
from megamamba.kernels import flops, ops
from megamamba.kernels.reference.mamba3 import ScanState, mamba3_scan_chunked, mamba3_scan_recurrent
from megamamba.kernels.triton import mamba3 as triton_mamba3
from triton_calls import triton_forward_and_backward_run

pytestmark = pytest.mark.usefixtures("poisoned_buffers", "triton_backend")
BATCH, SEQLEN, NHEADS, HEADDIM, DSTATE, CHUNK = 2, 37, 3, 8, 16, 16
NAMES = ("y", "ssm", "last_x", "last_B")
MIMO_RANK = 3


@pytest.fixture
def triton_backend(monkeypatch):
    """The op runs Triton on CPU tensors; the test fails unless Triton's forward and backward really ran."""
    with triton_forward_and_backward_run(monkeypatch, triton_mamba3, "Mamba-3 scan"):
        yield


def inputs(seed, *, initial_state, low_precision=None, rank=1):
    """The scan's inputs at the mixer's scale: Δ = softplus(·), A ≤ -0.5, λ = sigmoid(·); x, B̂ and Ĉ
    of `rank` channels and in `low_precision` when given, the rest float32 as the preprocessing computes
    them."""
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    low = functools.partial(torch.Tensor.to, dtype=low_precision or torch.float32)
    t = dict(
        x=low(r(BATCH, SEQLEN, NHEADS, rank, HEADDIM)),
        dt=torch.nn.functional.softplus(r(BATCH, SEQLEN, NHEADS) - 1),
        A=-0.5 - torch.rand(BATCH, SEQLEN, NHEADS, generator=gen),
        lam=torch.sigmoid(r(BATCH, SEQLEN, NHEADS)),
        B=low(r(BATCH, SEQLEN, NHEADS, rank, DSTATE)),
        C=low(r(BATCH, SEQLEN, NHEADS, rank, DSTATE)),
        D=r(NHEADS),
    )
    if initial_state:
        t.update(
            initial_ssm=r(BATCH, NHEADS, HEADDIM, DSTATE),
            initial_x=r(BATCH, NHEADS, rank, HEADDIM),
            initial_B=r(BATCH, NHEADS, rank, DSTATE),
        )
    return t


def documents():
    """Row 0: documents start inside chunk 0, exactly at chunk 2's start and one token before the end,
    the first id reused; row 1: one document."""
    row0 = [4] * 9 + [1] * 23 + [2] * 4 + [4]
    return torch.tensor([row0, [0] * SEQLEN], dtype=torch.int32)


def scan_with(scan, x, dt, A, lam, B, C, D, initial_ssm=None, initial_x=None, initial_B=None, **options):
    """scan's (y, final ssm, x, B̂), the initial state given as separate tensors."""
    initial = None if initial_ssm is None else ScanState(initial_ssm, initial_x, initial_B)
    y, final = scan(x, dt, A, lam, B, C, D=D, initial_state=initial, return_final_state=True, **options)
    return (y, *final)


ours = functools.partial(scan_with, megamamba.kernels.mamba3_scan, chunk_size=CHUNK)
exact = functools.partial(scan_with, mamba3_scan_recurrent)


def reference_in_bf16(**tensors):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return scan_with(mamba3_scan_chunked, chunk_size=CHUNK, **tensors)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("with_documents", [False, True])
def test_mamba3_scan_matches_float64_reference(with_documents, with_initial_state):
    seed = 70 + 2 * with_documents + with_initial_state
    options = dict(seq_idx=documents()) if with_documents else {}
    oracle_checks.check_against_oracle(
        ours, exact, inputs(seed, initial_state=with_initial_state), seed, names=NAMES, **options
    )


def test_mamba3_scan_gradients_stay_accurate_for_tiny_and_zero_steps():
    """|A| from 1e-4 (the default A_floor) to 1, Δ from 1e-3 to 2.7 and some Δ exactly 0: the key's scale
    (λΔ + ν)/(Δ|A|) reaches 1e7 (1e20 at the step floor), yet dΔ and dA stay within 1e-4, as the log-decay's
    gradient is read apart from that of the SSD's step as the input's scale."""
    seed = 76
    tensors = inputs(seed, initial_state=True)
    gen = torch.Generator().manual_seed(seed + 2)
    tensors["A"] = -torch.empty_like(tensors["A"]).uniform_(-9.2, 0.0, generator=gen).exp()
    tensors["dt"] = torch.empty_like(tensors["dt"]).uniform_(-7.0, 1.0, generator=gen).exp()
    tensors["dt"][:, 5:9] = 0.0
    oracle_checks.check_against_oracle(ours, exact, tensors, seed, names=NAMES, seq_idx=documents())


@pytest.mark.parametrize("rank", [1, MIMO_RANK])
def test_bf16_mamba3_scan_within_reference_computed_in_bf16(rank):
    """bf16 x, B̂, Ĉ; float32 Δ, A, λ, D and state, as the mixer keeps them."""
    seed = 79 + rank
    tensors = inputs(seed, initial_state=True, low_precision=torch.bfloat16, rank=rank)
    found = errors_of(
        {"ours": ours, "theirs": reference_in_bf16}, exact, tensors, seed, names=NAMES, seq_idx=documents()
    )
    assert_within_theirs(found["ours"], found["theirs"], seed)


def op_arguments(seed, seqlen=SEQLEN):
    """The op's arguments for the first `seqlen` positions, with documents and an initial state."""
    t = inputs(seed, initial_state=True)
    for name in ("x", "dt", "A", "lam", "B", "C"):
        t[name] = t[name][:, :seqlen]
    t = {k: v.detach().requires_grad_() for k, v in t.items()}
    state = (t["initial_ssm"], t["initial_x"], t["initial_B"])
    return (t["x"], t["dt"], t["A"], t["lam"], t["B"], t["C"], CHUNK, t["D"], *state, documents()[:, :seqlen], None)


@pytest.mark.slow  # 7 s alone, 11 s on a loaded machine
def test_mamba3_scan_op_and_its_backward_pass_opcheck():
    """On one chunk with a document start: opcheck runs each op a dozen times."""
    seed = 90
    args = op_arguments(seed, seqlen=11)
    results = torch.library.opcheck(ops.mamba3_scan, args)
    assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: forward {results}"
    y, ssm, last_x, last_B = ops.mamba3_scan(*args)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = (torch.randn(y.shape, generator=gen), None, torch.randn(last_x.shape, generator=gen), None)
    detached = (a.detach() if torch.is_tensor(a) else a for a in args)
    results = torch.library.opcheck(ops.mamba3_scan_backward, (*grads, *detached))
    assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: backward {results}"


def test_the_flop_counter_counts_mamba3_scan_by_its_formula():
    args = op_arguments(91)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        ops.mamba3_scan(*args)[0].sum().backward()
    forward = flops.mamba3_scan_flops(BATCH * SEQLEN, SEQLEN, NHEADS, 1, HEADDIM, DSTATE, CHUNK)
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counted == {"megamamba.mamba3_scan": forward, "megamamba.mamba3_scan_backward": 2 * forward}


def test_triton_module_scan_matches_float64_reference():
    """megamamba.kernels.triton.mamba3.mamba3_scan, its autograd.Function called without the op."""
    seed = 75
    scan = functools.partial(scan_with, triton_mamba3.mamba3_scan, chunk_size=CHUNK)
    tensors = inputs(seed, initial_state=True)
    oracle_checks.check_against_oracle(scan, exact, tensors, seed, names=NAMES, seq_idx=documents())
