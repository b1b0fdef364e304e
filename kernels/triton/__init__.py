"""Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1) behind the public kernel API."""

from .add_norm import add_rmsnorm
from .conv import causal_conv1d
from .norm import rmsnorm_gated
from .selective_scan import selective_scan
from .ssd import ssd_chunk_scan

__all__ = ["add_rmsnorm", "causal_conv1d", "rmsnorm_gated", "selective_scan", "ssd_chunk_scan"]
