"""Reference Mamba-2 SSD scan (chunked) against the naive per-timestep recurrence."""

import pytest
import torch

import naive_ops
from megamamba.kernels.reference.ssd import ssd_chunk_scan

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
BATCH, SEQLEN, NHEADS, HEADDIM, DSTATE, CHUNK = 2, 37, 4, 3, 5, 16


def documents():
    """Row 0: documents start at 5, 16 (a chunk edge) and 29; row 1: at 32 (a chunk edge) and 33,
    the last one reusing an earlier id (it is still a new document)."""
    seq = torch.zeros(BATCH, SEQLEN, dtype=torch.int32)
    seq[0, 5:], seq[0, 16:], seq[0, 29:] = 1, 2, 3
    seq[1, 32:], seq[1, 33:] = 7, 0
    return seq


def inputs(seed, ngroups=2, d_per_channel=True, seqlen=SEQLEN, full=True):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t = dict(
        x=randn(BATCH, seqlen, NHEADS, HEADDIM),
        dt=randn(BATCH, seqlen, NHEADS),
        A=-torch.rand(NHEADS, generator=gen, dtype=torch.float64) * 2 - 0.1,
        B=randn(BATCH, seqlen, ngroups, DSTATE),
        C=randn(BATCH, seqlen, ngroups, DSTATE),
        D=randn(NHEADS, HEADDIM) if d_per_channel else randn(NHEADS),
    )
    if full:
        t.update(
            z=randn(BATCH, seqlen, NHEADS, HEADDIM),
            dt_bias=randn(NHEADS),
            initial_states=randn(BATCH, NHEADS, HEADDIM, DSTATE),
        )
    return t


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_options_with_documents_match_naive(dtype):
    seed = 11
    naive_ops.assert_matches_naive(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        {**inputs(seed), "seq_idx": documents()},
        dtype,
        TOLERANCE[dtype],
        seed,
        chunk_size=CHUNK,
        dt_softplus=True,
        dt_limit=(0.05, 2.0),
        return_final_states=True,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_head_D_without_documents_matches_naive(dtype):
    seed = 12
    tensors = inputs(seed, ngroups=1, d_per_channel=False, full=False)
    tensors["dt"] = tensors["dt"].abs()
    naive_ops.assert_matches_naive(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        tensors,
        dtype,
        TOLERANCE[dtype],
        seed,
        chunk_size=CHUNK,
        return_final_states=True,
    )


def test_chunk_longer_than_sequence_matches_naive():
    seed = 13
    naive_ops.assert_matches_naive(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        {**inputs(seed, ngroups=4), "seq_idx": documents()},
        torch.float64,
        TOLERANCE[torch.float64],
        seed,
        chunk_size=64,
        dt_softplus=True,
        return_final_states=True,
    )


def test_default_dt_limit_zeroes_negative_dt():
    """As mamba_ssm, dt is always clamped to dt_limit, so the default (0, inf) turns dt < 0 into 0."""
    t = inputs(14, full=False)
    t["dt"] = -t["dt"].abs()
    y = ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"])
    assert torch.equal(y, t["x"] * t["D"])


def test_huge_decays_underflow_without_nan():
    t = inputs(15, full=False)
    t["dt"] = t["dt"].abs() * 100  # dt*A mostly below -104, where exp underflows in float32
    naive_ops.assert_matches_naive(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        t,
        torch.float32,
        TOLERANCE[torch.float32],
        15,
        chunk_size=CHUNK,
        return_final_states=True,
    )


def test_output_keeps_input_dtype_and_state_is_float32():
    t = {k: v.to(torch.bfloat16) for k, v in inputs(16, full=False).items()}
    y, state = ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, return_final_states=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("dt", (BATCH, SEQLEN, NHEADS + 1), r"dt must have shape \(batch, seqlen, nheads\)"),
        ("B", (BATCH, SEQLEN, 3, DSTATE), r"nheads \(4\) must be a multiple of ngroups \(3\)"),
        ("D", (HEADDIM,), r"D must have shape \(nheads,\)"),
        ("initial_states", (BATCH, NHEADS, HEADDIM), r"initial_states must have shape"),
    ],
)
def test_bad_shapes_are_refused_naming_the_argument(name, shape, message):
    t = inputs(17)
    t[name] = torch.zeros(shape, dtype=torch.float64)
    if name == "B":
        t["C"] = t["B"]
    with pytest.raises(ValueError, match=message):
        ssd_chunk_scan(chunk_size=CHUNK, **t)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_documents_match_naive(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    seqlen = int(torch.randint(1, 90, (1,), generator=gen))
    chunk = int(torch.randint(1, 40, (1,), generator=gen))
    ngroups = [1, 2, 4][int(torch.randint(0, 3, (1,), generator=gen))]
    tensors = inputs(1000 + seed, ngroups=ngroups, seqlen=seqlen)
    starts = torch.rand(BATCH, seqlen, generator=gen) < 0.1
    tensors["seq_idx"] = starts.int().cumsum(1).int()
    for dtype in (torch.float64, torch.float32):
        naive_ops.assert_matches_naive(
            ssd_chunk_scan,
            naive_ops.ssd_chunk_scan,
            tensors,
            dtype,
            TOLERANCE[dtype],
            1000 + seed,
            chunk_size=chunk,
            dt_softplus=True,
            return_final_states=True,
        )


@pytest.mark.slow
def test_long_sequence_with_default_chunk_matches_naive_in_float32():
    """600 steps, chunk 256, strong decays (A down to -16) as in trained models."""
    gen = torch.Generator().manual_seed(3000)
    batch, seqlen, nheads, headdim, dstate = 1, 600, 2, 8, 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = dict(
        x=randn(batch, seqlen, nheads, headdim),
        dt=randn(batch, seqlen, nheads) - 3,
        A=-torch.rand(nheads, generator=gen, dtype=torch.float64) * 15 - 1,
        B=randn(batch, seqlen, 1, dstate),
        C=randn(batch, seqlen, 1, dstate),
        D=randn(nheads),
        dt_bias=randn(nheads),
        seq_idx=(torch.arange(seqlen) >= 256).int()[None],
    )
    naive_ops.assert_matches_naive(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        tensors,
        torch.float32,
        TOLERANCE[torch.float32],
        3000,
        chunk_size=256,
        dt_softplus=True,
        return_final_states=True,
    )
