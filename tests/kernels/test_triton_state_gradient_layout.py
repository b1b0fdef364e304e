"""The Triton scans read the final state's gradient through any layout: `final.sum()` hands them an
expanded (stride 0) gradient, which they once read as contiguous, past its one element (NaN)."""

import pytest
import torch

from megamamba.kernels.reference.selective_scan import selective_scan as reference_selective_scan
from megamamba.kernels.reference.ssd import ssd_chunk_scan as reference_ssd_chunk_scan
from megamamba.kernels.triton import selective_scan, ssd_chunk_scan
from megamamba.testing.numerics import relative_error

pytestmark = pytest.mark.slow  # the interpreter


def gradients(fn, tensors, **options):
    """Gradients of every tensor under out.sum() + final.sum(): both output gradients expanded."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
    out, final = fn(**leaves, **options)
    (out.sum() + final.sum()).backward()
    return {k: v.grad for k, v in leaves.items()}


def check(fn, reference, tensors, seed, **options):
    found = gradients(fn, tensors, **options)
    exact = gradients(reference, {k: v.double() for k, v in tensors.items()}, **options)
    for name, grad in found.items():
        err = relative_error(grad, exact[name])
        assert err <= 1e-4, f"seed {seed}: grad of {name} rel err {err:.2e}"


def test_ssd_reads_an_expanded_final_state_gradient():
    seed = 71
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, nheads, headdim, ngroups, dstate = 2, 21, 4, 5, 2, 6
    tensors = dict(
        x=torch.randn(batch, seqlen, nheads, headdim, generator=gen),
        dt=torch.rand(batch, seqlen, nheads, generator=gen),
        A=-torch.rand(nheads, generator=gen),
        B=torch.randn(batch, seqlen, ngroups, dstate, generator=gen),
        C=torch.randn(batch, seqlen, ngroups, dstate, generator=gen),
    )
    check(ssd_chunk_scan, reference_ssd_chunk_scan, tensors, seed, chunk_size=8, return_final_states=True)


def test_selective_scan_reads_an_expanded_last_state_gradient():
    seed = 72
    gen = torch.Generator().manual_seed(seed)
    batch, dim, seqlen, dstate = 2, 6, 19, 5
    tensors = dict(
        u=torch.randn(batch, dim, seqlen, generator=gen),
        delta=torch.rand(batch, dim, seqlen, generator=gen),
        A=-torch.rand(dim, dstate, generator=gen),
        B=torch.randn(batch, 1, dstate, seqlen, generator=gen),
        C=torch.randn(batch, 1, dstate, seqlen, generator=gen),
    )
    check(selective_scan, reference_selective_scan, tensors, seed, return_last_state=True)
