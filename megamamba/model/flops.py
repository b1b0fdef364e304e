"""FLOPs of a Mamba or hybrid LM, for TFLOP/s and MFU in the training log and the pipeline's cost partition.

Per token of a forward pass, a multiply-add as 2 FLOPs; training is 3x the forward, recomputation
not counted. Each layer's count is its type's (`megamamba.model.layer_types`): matmuls and the scans are
counted; norms, activations, rotary and softmax are not. Attention counts its causal half: QK^T and AV
over s/2 keys on average (as Megatron-LM counts; nanoGPT and PaLM count all s keys, twice this term).
What is counted, and the scans' formulas: docs/code.md.
"""

from megamamba.config import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layers import layer_kinds


def layer_flops(config: MambaConfig, seq_length: int) -> list:
    """Forward FLOPs per token of each layer of the layer list (`megamamba.model.layers`)."""
    per_kind = {kind: layer_type(kind).flops_per_token(config, seq_length) for kind in set(layer_kinds(config))}
    return [per_kind[kind] for kind in layer_kinds(config)]


def forward_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """All layers plus the LM head (padded vocabulary), forward, per token."""
    return sum(layer_flops(config, seq_length))


def training_flops_per_token(config: MambaConfig, seq_length: int) -> int:
    """Forward + backward (3x forward), recomputation excluded."""
    return 3 * forward_flops_per_token(config, seq_length)
