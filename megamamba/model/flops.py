"""FLOPs of a Mamba LM, for TFLOP/s and MFU in the training log.

Per token of a forward pass, a multiply-add as 2 FLOPs; training is 3x the forward, recomputation
not counted. What is counted, and the scans' formulas: docs/code.md.
"""
from megamamba.config import Mamba1Options, MambaConfig


def mamba1_layer_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one Mamba-1 mixer."""
    o = config.mixer_options
    d, di, n, r = config.d_model, config.d_inner, o.d_state, config.dt_rank
    projections = 2 * d * 2 * di + 2 * di * (r + 2 * n) + 2 * r * di + 2 * di * d
    return projections + 2 * di * o.d_conv + 9 * di * n


def mamba2_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one Mamba-2 mixer at sequence length `seq_length`."""
    o = config.mixer_options
    d, di, n, g, h = config.d_model, config.d_inner, o.d_state, o.ngroups, config.nheads
    q = min(o.chunk_size, seq_length)
    d_in_proj = 2 * di + 2 * g * n + h
    conv_dim = di + 2 * g * n
    projections = 2 * d * d_in_proj + 2 * di * d
    ssd = 2 * q * n * g + 2 * q * di + 2 * n * di + 2 * n * di
    return projections + 2 * conv_dim * o.d_conv + ssd


def forward_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """All layers plus the LM head (padded vocabulary), forward, per token."""
    if isinstance(config.mixer_options, Mamba1Options):
        layer = mamba1_layer_flops(config)
    else:
        layer = mamba2_layer_flops(config, seq_length)
    return config.n_layer * layer + 2 * config.d_model * config.padded_vocab_size


def training_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """Forward + backward (3x forward), recomputation excluded."""
    return 3 * forward_flops_per_token(config, seq_length)
