"""Make Triton's interpreter compute bf16 as a GPU does, so bf16 kernels can be checked on the CPU.

The interpreter keeps bf16 values as raw 16-bit patterns: its `tl.dot` multiplies those integers
(a 16x16 bf16 dot is off by about 4e9 relative), and its float32 -> bf16 casts truncate where a
GPU rounds to nearest even. `install()` widens bf16 dot operands to float32 (exact products,
float32 sums: the tensor-core contract, as the interpreter already does for fp8) and rounds
downcasts to bf16 to nearest even. Checked against Triton 3.6 and 3.9.
"""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_BF16_BITS = np.dtype(np.uint16)


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> the float32 values they stand for (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _widened(handle) -> np.ndarray:
    return _bf16_to_float32(handle.data) if handle.dtype.scalar == tl.bfloat16 else handle.data


def install() -> None:
    """Patch the interpreter's bf16 dot and its float -> bf16 casts (idempotent)."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_megamamba_bf16", False):
        return
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.matmul(_widened(a).astype(np.float32), _widened(b).astype(np.float32), dtype=np.float32)
        return interpreter.TensorHandle((out + d.data).astype(d.data.dtype), d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
            return interpreter.TensorHandle(_float32_to_bf16(src.data.astype(np.float32)), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    builder._megamamba_bf16 = True
