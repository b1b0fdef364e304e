"""Helpers shared by the Triton ops: output allocation, document counters, launch sizes, softplus, the
combine step of a linear recurrence's scan."""

import functools
import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def empty(shape, *, device, dtype) -> torch.Tensor:
    """Allocate a buffer every element of which a kernel must write.

    All such buffers go through here, so a test can replace this function with one that
    fills them with NaN and catch any element a kernel forgot to write.
    """
    return torch.empty(shape, device=device, dtype=dtype)


_last_counters = (None, -1, None)  # (weakref to a seq_idx, its version, its counters)


def document_counters(seq_idx, batch: int, seqlen: int):
    """int32 (batch, seqlen) counters that grow by one wherever seq_idx changes, or None.

    Kernels compare counters for equality; counting changes (instead of comparing raw ids)
    keeps a reused id (documents A, B, A) from joining two separate documents. The counters of
    the last seq_idx are kept while that tensor lives unmodified, so the layers of one forward,
    which all receive the same seq_idx, compute them once.
    """
    global _last_counters
    if seq_idx is None:
        return None
    if tuple(seq_idx.shape) != (batch, seqlen):
        raise ValueError(f"seq_idx must have shape (batch, seqlen) = {(batch, seqlen)}, got {tuple(seq_idx.shape)}")
    if seq_idx.is_floating_point() or seq_idx.is_complex():
        raise ValueError(f"seq_idx must hold integer document ids, got dtype {seq_idx.dtype}")
    ref, version, counters = _last_counters
    current = None if seq_idx.is_inference() else seq_idx._version  # inference tensors have no version
    if current is not None and ref is not None and ref() is seq_idx and version == current:
        return counters
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    counters = F.pad(changes.cumsum(1, dtype=torch.int32), (1, 0)).contiguous()
    if current is not None:
        _last_counters = (weakref.ref(seq_idx), current, counters)
    return counters


def multiprocessors(device) -> int:
    """Streaming multiprocessors of a CUDA device (a few for the interpreter on the CPU)."""
    if device.type != "cuda":
        return 2
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block(n: int, lo: int = 16, hi: int = 1 << 30) -> int:
    """Power-of-two block covering n, clamped to [lo, hi] (tl.dot needs sides >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(n)))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact IEEE products for float32 inputs (no TF32 rounding)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def softplus(v):
    """log(1 + exp(v)) to float32 round-off: log1p(e) as log(w) * e / (w - 1), w = 1 + e, keeps the
    low bits of e that w drops (Goldberg 1991), which log(1 + e) loses for the small steps of
    trained Mamba layers (softplus inputs of about -7 to -2)."""
    e = tl.exp(-tl.abs(v))
    w = 1.0 + e
    return tl.maximum(v, 0.0) + tl.where(w == 1.0, e, tl.log(w) * (e / (w - 1.0)))


@triton.jit
def combine_steps(a1, b1, a2, b2):
    """tl.associative_scan's combine for h -> a h + b: step (a1, b1) then step (a2, b2) is h -> a2 (a1 h + b1) + b2."""
    return a1 * a2, a2 * b1 + b2
