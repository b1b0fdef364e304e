"""megamamba.kernels: scan, conv and norm ops, Triton on CUDA and the PyTorch reference elsewhere (see dispatch)."""

from .dispatch import (
    add_rmsnorm,
    causal_conv1d,
    causal_conv1d_update,
    mamba3_scan,
    mamba3_scan_inputs,
    rmsnorm_gated,
    selective_scan,
    selective_state_update,
    ssd_chunk_scan,
)

__all__ = [
    "add_rmsnorm",
    "causal_conv1d",
    "causal_conv1d_update",
    "mamba3_scan",
    "mamba3_scan_inputs",
    "rmsnorm_gated",
    "selective_scan",
    "selective_state_update",
    "ssd_chunk_scan",
]
