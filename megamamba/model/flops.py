"""FLOPs of a Mamba or hybrid LM, for TFLOP/s and MFU in the training log and the pipeline's cost partition.

Per token of a forward pass, a multiply-add as 2 FLOPs; training is 3x the forward, recomputation
not counted. Matmuls and the scans are counted; norms, activations, rotary and softmax are not.
Attention counts its causal half: QK^T and AV over s/2 keys on average (as Megatron-LM counts;
nanoGPT and PaLM count all s keys, twice this term). What is counted, and the scans' formulas:
docs/code.md.
"""

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.kernels.flops import conv_flops, selective_scan_flops, ssd_flops
from megamamba.model.layers import layer_kinds


def mamba1_layer_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one Mamba-1 mixer."""
    o = config.mixer_options
    d, di, n, r = config.d_model, config.d_inner, o.d_state, config.dt_rank
    projections = 2 * d * 2 * di + 2 * di * (r + 2 * n) + 2 * r * di + 2 * di * d
    return projections + conv_flops(1, di, o.d_conv) + selective_scan_flops(1, di, n)


def mamba2_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one Mamba-2 mixer at sequence length `seq_length`."""
    o = config.mixer_options
    d, di, n, g, h = config.d_model, config.d_inner, o.d_state, o.ngroups, config.nheads
    d_in_proj = 2 * di + 2 * g * n + h
    conv_dim = di + 2 * g * n
    projections = 2 * d * d_in_proj + 2 * di * d
    ssd = ssd_flops(1, seq_length, h, di // h, g, n, o.chunk_size)
    return projections + conv_flops(1, conv_dim, o.d_conv) + ssd


def attention_projection_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of an attention mixer's in_proj (q, k, v) and out_proj."""
    o = config.attention_options
    head_dim = config.head_dim_of(o)
    return 2 * config.d_model * (o.num_heads + 2 * o.kv_heads) * head_dim + 2 * o.num_heads * head_dim * config.d_model


def attention_core_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of QK^T and AV under the causal mask: s/2 keys per query on average."""
    o = config.attention_options
    return 2 * 2 * o.num_heads * config.head_dim_of(o) * seq_length // 2


def attention_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one attention mixer at sequence length `seq_length`."""
    return attention_projection_flops(config) + attention_core_flops(config, seq_length)


def mlp_fc1_width(config: MambaConfig) -> int:
    """Output width of an MLP's fc1: twice `mlp_width` when gated (SiLU), the gate's half with the value's."""
    return 2 * config.mlp_width if config.mlp_activation == "gated_silu" else config.mlp_width


def mlp_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one MLP: fc1 and fc2."""
    return 2 * config.d_model * mlp_fc1_width(config) + 2 * config.mlp_width * config.d_model


def mamba_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of the configured Mamba mixer."""
    if isinstance(config.mixer_options, Mamba1Options):
        return mamba1_layer_flops(config)
    return mamba2_layer_flops(config, seq_length)


def layer_flops(config: MambaConfig, seq_length: int) -> list:
    """Forward FLOPs per token of each layer of the layer list (`megamamba.model.layers`): the embedding 0,
    each block's mixer (with mamba_ssm's d_intermediate, plus its MLP), the final norm 0, the head."""
    inside = mlp_flops(config) if config.mlp_inside_blocks else 0
    per_kind = {
        "embedding": 0,
        "final_norm": 0,
        "head": 2 * config.d_model * config.padded_vocab_size,
        "mlp": mlp_flops(config),
    }
    if "mamba" in config.block_kinds:
        per_kind["mamba"] = mamba_layer_flops(config, seq_length) + inside
    if "attention" in config.block_kinds:
        per_kind["attention"] = attention_layer_flops(config, seq_length) + inside
    return [per_kind[kind] for kind in layer_kinds(config)]


def forward_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """All layers plus the LM head (padded vocabulary), forward, per token."""
    return sum(layer_flops(config, seq_length))


def training_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """Forward + backward (3x forward), recomputation excluded."""
    return 3 * forward_flops_per_token(config, seq_length)
