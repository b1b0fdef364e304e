"""Triton add_rmsnorm (under TRITON_INTERPRET=1 on the CPU) against the reference in float64: the
normed output, the new residual and every gradient within 1e-4 relative in float32."""

import pytest
import torch

from megamamba.kernels.reference.add_norm import add_rmsnorm as reference_add_rmsnorm
from megamamba.kernels.triton import add_rmsnorm
from oracle_checks import check_against_oracle

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,n", [(21, 36), (301, 36), (3, 1000)])
def test_add_rmsnorm_matches_oracle(with_residual, rows, n):
    """Odd widths; 301 rows make each backward program walk several row blocks, past the end."""
    seed = 2000 + rows + n + with_residual
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(x=torch.randn(rows, n, generator=gen), weight=1 + 0.1 * torch.randn(n, generator=gen))
    if with_residual:
        tensors["residual"] = torch.randn(rows, n, generator=gen)
    else:
        tensors["residual"] = None
    check_against_oracle(
        lambda residual=None, **t: add_rmsnorm(residual=residual, **t),
        lambda residual=None, **t: reference_add_rmsnorm(residual=residual, **t),
        {k: v for k, v in tensors.items() if v is not None},
        seed,
        names=("normed", "residual"),
        eps=1e-5,
    )


def test_only_the_residual_output_used_gives_its_gradient():
    x = torch.randn(2, 5, 12, requires_grad=True)
    residual = torch.randn(2, 5, 12, requires_grad=True)
    _, out = add_rmsnorm(x, residual, torch.ones(12, requires_grad=True))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(residual.grad, torch.ones_like(x))
