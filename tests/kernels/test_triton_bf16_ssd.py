"""Triton ssd_chunk_scan in bf16 (under the interpreter's GPU-like bf16, megamamba/testing/interpreter_bf16.py)
against the float64 per-timestep oracle, beside mamba_ssm's mamba_chunk_scan_combined on the
same inputs: the output and every gradient at most 1.5 times its error (tests/kernels/bf16_checks.py).

bf16 x, dt, B, C, z as the Mamba-2 mixer passes them under autocast; float32 A, D, dt_bias and
states as it keeps them. Sequences end inside a chunk; two lengths show the errors do not grow
with the sequence faster than mamba_ssm's.
"""

import functools

import pytest
import torch

import naive_ops
from bf16_checks import assert_within_theirs, errors_of
from megamamba.kernels.triton import ssd_chunk_scan

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
NHEADS, HEADDIM, NGROUPS, DSTATE, CHUNK = 4, 16, 2, 32, 64
OPTIONS = dict(chunk_size=CHUNK, dt_softplus=True)


def inputs(seed, batch, seqlen, *, d_shape=(NHEADS,), initial_states=False):
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    bf16 = torch.bfloat16
    t = dict(
        x=r(batch, seqlen, NHEADS, HEADDIM).to(bf16),
        dt=(r(batch, seqlen, NHEADS) - 1.0).to(bf16),
        A=-0.5 - torch.rand(NHEADS, generator=gen),
        B=r(batch, seqlen, NGROUPS, DSTATE).to(bf16),
        C=r(batch, seqlen, NGROUPS, DSTATE).to(bf16),
        D=r(*d_shape),
        z=r(batch, seqlen, NHEADS, HEADDIM).to(bf16),
        dt_bias=0.5 * r(NHEADS),
    )
    if initial_states:
        t["initial_states"] = r(batch, NHEADS, HEADDIM, DSTATE)
    return t


def documents(batch, seqlen):
    """Row 0: a boundary inside the first chunk, one exactly at a chunk start and one late; row 1: one document."""
    ids = torch.zeros(batch, seqlen, dtype=torch.int32)
    ids[0, 11:], ids[0, 2 * CHUNK :], ids[0, seqlen - 9 :] = 1, 2, 3
    return ids


def compare(tensors, seed, mamba_ssm, names=("y",), **options):
    found = errors_of(
        {"ours": ssd_chunk_scan, "theirs": mamba_ssm.mamba_chunk_scan_combined},
        naive_ops.ssd_chunk_scan,
        tensors,
        seed,
        names=names,
        **OPTIONS,
        **options,
    )
    assert_within_theirs(found["ours"], found["theirs"], seed)


@pytest.mark.parametrize("batch, seqlen", [(2, 75), (1, 150)])
def test_bf16_ssd_chunk_scan_within_mamba_ssm_error(batch, seqlen, mamba_ssm):
    seed = 60 + seqlen
    compare(inputs(seed, batch, seqlen), seed, mamba_ssm)


def test_bf16_ssd_chunk_scan_with_documents_within_mamba_ssm_error(mamba_ssm):
    seed, batch, seqlen = 61, 2, 139
    compare(inputs(seed, batch, seqlen), seed, mamba_ssm, seq_idx=documents(batch, seqlen))


def test_bf16_ssd_chunk_scan_state_pieces_within_mamba_ssm_error(mamba_ssm):
    """What context parallelism and generation use: an initial state in, the final state out, and a
    gradient flowing back through both."""
    seed = 62
    compare(
        inputs(seed, 2, 107, initial_states=True),
        seed,
        mamba_ssm,
        names=("y", "final_states"),
        return_final_states=True,
    )


def test_bf16_ssd_chunk_scan_per_channel_D_within_mamba_ssm_error(mamba_ssm):
    seed = 63
    compare(inputs(seed, 1, 90, d_shape=(NHEADS, HEADDIM)), seed, mamba_ssm)
