"""The bf16 for Triton's interpreter (megamamba/testing/interpreter_bf16.py): a bf16 dot is the
float32 matmul of the bf16 values, a float32 dot is untouched, and float32 -> bf16 casts round to
nearest even as torch (and a GPU) do."""

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from megamamba.testing.numerics import relative_error

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks Triton's interpreter")
SEED = 7


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, SIZE: tl.constexpr):
    i = tl.arange(0, SIZE)
    tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))


def _dot(a, b):
    out = torch.empty(a.shape[0], b.shape[1])
    _dot_kernel[(1,)](a, b, out, M=a.shape[0], K=a.shape[1], N=b.shape[1])
    return out


def _operands(dtype):
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(32, 64, generator=gen).to(dtype), torch.randn(64, 16, generator=gen).to(dtype)


def test_bf16_dot_equals_the_float32_matmul_of_the_same_rounded_operands():
    a, b = _operands(torch.bfloat16)
    exact = a.double() @ b.double()
    out = _dot(a, b)
    err = relative_error(out, exact)
    assert err <= 1e-6, f"seed {SEED}: bf16 dot rel err {err:.2e} against the float64 matmul of its operands"


def test_float32_dot_is_unchanged():
    a, b = _operands(torch.float32)
    assert torch.equal(_dot(a, b), torch.from_numpy(np.matmul(a.numpy(), b.numpy()))), f"seed {SEED}"


def test_float32_to_bf16_cast_rounds_to_nearest_even_as_torch():
    gen = torch.Generator().manual_seed(SEED)
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8)])  # halfway: to the even neighbour
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4e38, 1e-40, -1e-40, 1e-45])
    x = torch.cat([torch.randn(1024 - 11, generator=gen), ties, special])
    out = torch.empty(1024, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, SIZE=1024)
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16)), (
        f"seed {SEED}: {(out != x.bfloat16()).sum().item()} casts differ from torch's"
    )


def test_float32_to_bf16_cast_keeps_nan():
    x = torch.full((16,), float("nan"))
    out = torch.zeros(16, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, SIZE=16)
    assert torch.isnan(out).all()
