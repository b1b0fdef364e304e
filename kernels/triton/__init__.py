"""Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1) behind the public kernel API."""
from .conv import causal_conv1d
from .norm import rmsnorm_gated

__all__ = ["causal_conv1d", "rmsnorm_gated"]
