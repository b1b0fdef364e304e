"""parallel_linear on one rank: the fused autograd function equals F.linear, also under autocast."""

import torch
import torch.nn.functional as F

from megamamba.parallel import TensorParallel, parallel_linear
from megamamba.testing.numerics import relative_error

SEED = 11


def _inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in [(3, 5, 7), (9, 7), (9,)]]


def test_output_and_gradients_equal_f_linear():
    ours, ref = _inputs(), _inputs()
    up = torch.randn(3, 5, 9, generator=torch.Generator().manual_seed(SEED + 1), dtype=torch.float64)
    (parallel_linear(*ours, TensorParallel()) * up).sum().backward()
    (F.linear(*ref) * up).sum().backward()
    for a, b in zip(ours, ref):
        assert torch.isfinite(a.grad).all()
        assert relative_error(a.grad, b.grad) <= 1e-12, f"seed {SEED}"


def test_autocast_runs_the_matmul_in_bfloat16_like_f_linear():
    ours, ref = _inputs(torch.float32), _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = parallel_linear(*ours, TensorParallel()), F.linear(*ref)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    for a, b in zip(ours, ref):
        assert a.grad.dtype == torch.float32
        assert torch.equal(a.grad, b.grad)
