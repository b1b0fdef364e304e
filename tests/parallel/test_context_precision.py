"""The state-passing correction keeps float32 under bf16 autocast, as the scan kernels keep theirs."""

import torch

from megamamba.parallel.context.context_slice import _ssd_contribution

SEED = 11


def test_the_mamba2_correction_is_float32_under_bf16_autocast():
    gen = torch.Generator().manual_seed(SEED)
    batch, seqlen, ngroups, nheads, headdim, dstate = 2, 7, 1, 4, 3, 5
    C = torch.randn(batch, seqlen, ngroups, dstate, generator=gen)
    h0 = torch.randn(batch, nheads, headdim, dstate, generator=gen)
    z = torch.randn(batch, seqlen, nheads, headdim, generator=gen)
    dt = torch.rand(batch, seqlen, nheads, generator=gen)
    A = -torch.rand(nheads, generator=gen)
    reaches = torch.ones(batch, seqlen, dtype=torch.bool)
    args = (C, h0, z, dt, None, A, reaches, False, (0.0, float("inf")))
    exact = _ssd_contribution(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = _ssd_contribution(*args)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, exact), f"seed {SEED}"
