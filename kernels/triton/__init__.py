"""Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""
