"""Reference Mamba-1 selective scan (chunked) against the naive per-timestep recurrence."""

import pytest
import torch

import naive_ops
from megamamba.kernels.reference import selective_scan as module
from megamamba.kernels.reference.selective_scan import selective_scan

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
BATCH, DIM, SEQLEN, DSTATE, GROUPS = 2, 6, 37, 4, 3
LAYOUTS = {  # shapes of B and C
    "grouped": ((BATCH, GROUPS, DSTATE, SEQLEN),) * 2,
    "one group": ((BATCH, DSTATE, SEQLEN),) * 2,
    "constant": ((DIM, DSTATE),) * 2,
    "constant B, grouped C": ((DIM, DSTATE), (BATCH, GROUPS, DSTATE, SEQLEN)),
}


def documents():
    """Row 0: documents start at 5, at a chunk edge and at 29; row 1: at a later chunk edge and
    one step after it, the last one reusing an earlier id (it is still a new document)."""
    chunk = module.chunk_length(SEQLEN)
    seq = torch.zeros(BATCH, SEQLEN, dtype=torch.int32)
    seq[0, 5:], seq[0, 2 * chunk :], seq[0, 29:] = 1, 2, 3
    seq[1, 4 * chunk :], seq[1, 4 * chunk + 1 :] = 7, 0
    return seq


def inputs(seed, layout="grouped", seqlen=SEQLEN):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b_shape, c_shape = LAYOUTS[layout]
    if seqlen != SEQLEN:
        b_shape, c_shape = [s[:-1] + (seqlen,) if len(s) > 2 else s for s in (b_shape, c_shape)]
    return dict(
        u=randn(BATCH, DIM, seqlen),
        delta=randn(BATCH, DIM, seqlen),
        A=-torch.rand(DIM, DSTATE, generator=gen, dtype=torch.float64) * 2 - 0.1,
        B=randn(*b_shape),
        C=randn(*c_shape),
        D=randn(DIM),
        z=randn(BATCH, DIM, seqlen),
        delta_bias=randn(DIM),
    )


def test_internal_chunk_does_not_divide_the_test_length():
    chunk = module.chunk_length(SEQLEN)
    assert SEQLEN % chunk != 0 and 4 * chunk + 1 < SEQLEN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_options_with_documents_match_naive(dtype):
    seed = 21
    naive_ops.assert_matches_naive(
        selective_scan,
        naive_ops.selective_scan,
        {**inputs(seed), "seq_idx": documents()},
        dtype,
        TOLERANCE[dtype],
        seed,
        delta_softplus=True,
        return_last_state=True,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_documents", [False, True])
def test_initial_state_matches_naive(dtype, with_documents):
    """The initial state reaches only the first document; it and its gradient match the oracle."""
    seed = 27
    t = inputs(seed)
    t["initial_state"] = torch.randn(
        BATCH, DIM, DSTATE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    if with_documents:
        t["seq_idx"] = documents()
    naive_ops.assert_matches_naive(
        selective_scan,
        naive_ops.selective_scan,
        t,
        dtype,
        TOLERANCE[dtype],
        seed,
        delta_softplus=True,
        return_last_state=True,
    )


@pytest.mark.parametrize("layout", ["one group", "constant", "constant B, grouped C"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_B_C_layout_matches_naive(layout, dtype):
    seed = 22
    naive_ops.assert_matches_naive(
        selective_scan,
        naive_ops.selective_scan,
        inputs(seed, layout),
        dtype,
        TOLERANCE[dtype],
        seed,
        delta_softplus=True,
        return_last_state=True,
    )


def test_without_optional_inputs_matches_naive():
    seed = 23
    t = inputs(seed)
    t = {k: t[k] for k in ("u", "A", "B", "C")} | {"delta": t["delta"].abs()}
    naive_ops.assert_matches_naive(
        selective_scan, naive_ops.selective_scan, t, torch.float64, TOLERANCE[torch.float64], seed
    )


def test_huge_decays_underflow_without_nan():
    seed = 24
    t = inputs(seed)
    t["delta"] = t["delta"].abs() * 100  # delta*A mostly below -104, where exp underflows in float32
    del t["delta_bias"]
    naive_ops.assert_matches_naive(
        selective_scan,
        naive_ops.selective_scan,
        t,
        torch.float32,
        TOLERANCE[torch.float32],
        seed,
        return_last_state=True,
    )


def test_output_keeps_input_dtype_and_state_is_float32():
    t = {k: v.to(torch.bfloat16) for k, v in inputs(25).items()}
    out, state = selective_scan(**t, return_last_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("delta", (BATCH, DIM, SEQLEN + 1), r"delta must have shape \(batch, dim, seqlen\)"),
        ("A", (DIM + 1, DSTATE), r"A must have shape \(dim, dstate\) with dim = 6"),
        ("B", (BATCH, 4, DSTATE, SEQLEN), r"B has 4 groups, which must divide dim \(6\)"),
        ("C", (BATCH, DSTATE, SEQLEN + 2), r"C must have shape \(batch, dstate, seqlen\)"),
        ("D", (DIM, 1), r"D must have shape \(dim,\)"),
        ("initial_state", (BATCH, DIM, DSTATE + 1), r"initial_state must have shape \(batch, dim, dstate\)"),
    ],
)
def test_bad_shapes_are_refused_naming_the_argument(name, shape, message):
    t = inputs(26)
    t[name] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        selective_scan(**t)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_lengths_and_documents_match_naive(seed):
    gen = torch.Generator().manual_seed(2000 + seed)
    seqlen = int(torch.randint(1, 90, (1,), generator=gen))
    tensors = inputs(2000 + seed, seqlen=seqlen)
    tensors["seq_idx"] = (torch.rand(BATCH, seqlen, generator=gen) < 0.1).int().cumsum(1).int()
    for dtype in (torch.float64, torch.float32):
        naive_ops.assert_matches_naive(
            selective_scan,
            naive_ops.selective_scan,
            tensors,
            dtype,
            TOLERANCE[dtype],
            2000 + seed,
            delta_softplus=True,
            return_last_state=True,
        )


@pytest.mark.slow
def test_long_sequence_matches_naive_in_float32():
    """600 steps with A = -1 ... -16 per state, as mamba_ssm initialises it."""
    gen = torch.Generator().manual_seed(3001)
    batch, dim, seqlen, dstate = 1, 16, 600, 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = dict(
        u=randn(batch, dim, seqlen),
        delta=randn(batch, dim, seqlen) - 3,
        A=-torch.arange(1, dstate + 1, dtype=torch.float64).repeat(dim, 1),
        B=randn(batch, dstate, seqlen),
        C=randn(batch, dstate, seqlen),
        D=randn(dim),
        delta_bias=randn(dim),
        seq_idx=(torch.arange(seqlen) >= 300).int()[None],
    )
    naive_ops.assert_matches_naive(
        selective_scan,
        naive_ops.selective_scan,
        tensors,
        torch.float32,
        TOLERANCE[torch.float32],
        3001,
        delta_softplus=True,
        return_last_state=True,
    )
