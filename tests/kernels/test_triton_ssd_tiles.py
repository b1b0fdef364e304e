"""Triton ssd_chunk_scan's sm_90 tiling (under TRITON_INTERPRET=1 on the CPU) against the float64
oracle: chunks of 64 positions, whose row blocks of 64 the scan, dx and dB/dC kernels walk in
steps of 32, and a dstate of 48, which _dx_kernel multiplies in float32 slices of 32 states (the
last one half masked). The output, the final state and every gradient within 1e-4 relative."""

import functools

import pytest
import torch

import naive_ops
import oracle_checks
from megamamba.kernels.triton import ssd_chunk_scan

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
BATCH, SEQLEN, NHEADS, HEADDIM, NGROUPS, DSTATE, CHUNK = 1, 150, 2, 8, 1, 48, 64


def test_chunks_of_64_and_dstate_48_with_documents_and_initial_states_match_oracle():
    seed = 30
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    tensors = dict(
        x=r(BATCH, SEQLEN, NHEADS, HEADDIM),
        dt=r(BATCH, SEQLEN, NHEADS),
        A=-0.5 - torch.rand(NHEADS, generator=gen),
        B=r(BATCH, SEQLEN, NGROUPS, DSTATE),
        C=r(BATCH, SEQLEN, NGROUPS, DSTATE),
        D=r(NHEADS),
        z=r(BATCH, SEQLEN, NHEADS, HEADDIM),
        dt_bias=r(NHEADS),
        initial_states=r(BATCH, NHEADS, HEADDIM, DSTATE),
    )
    seq_idx = (torch.arange(SEQLEN) >= 90).to(torch.int32)[None]  # a document starts inside chunk 1
    oracle_checks.check_against_oracle(
        ssd_chunk_scan,
        naive_ops.ssd_chunk_scan,
        tensors,
        seed,
        names=("y", "final_states"),
        chunk_size=CHUNK,
        seq_idx=seq_idx,
        dt_softplus=True,
        return_final_states=True,
    )
