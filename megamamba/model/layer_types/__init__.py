"""The kinds of layer the model's list is made of, one module each: a kind's module classes and its
`LayerType`, what the framework knows of it (`base.py`). `layer_type(kind)` finds a kind's; `register` adds
a kind of block, with its letter for hybrid_layer_pattern (or the mixer whose M blocks it is).
"""

from megamamba.config import MIXER_KINDS, PATTERN_SYMBOLS, ConfigError
from megamamba.model.layer_types.attention import ATTENTION_TYPE
from megamamba.model.layer_types.base import BlockType, LayerType
from megamamba.model.layer_types.embedding import EMBEDDING_TYPE
from megamamba.model.layer_types.final_norm import FINAL_NORM_TYPE
from megamamba.model.layer_types.head import HEAD_TYPE
from megamamba.model.layer_types.mamba import MAMBA_TYPE
from megamamba.model.layer_types.mamba3 import MAMBA3_TYPE
from megamamba.model.layer_types.mlp import MLP_TYPE
from megamamba.model.layer_types.moe import MOE_TYPE

LAYER_TYPES: dict[str, LayerType] = {t.kind: t for t in (EMBEDDING_TYPE, FINAL_NORM_TYPE, HEAD_TYPE)}


def layer_type(kind: str) -> LayerType:
    """The registered type of the layers of `kind` (`megamamba.model.layers.layer_kinds`)."""
    try:
        return LAYER_TYPES[kind]
    except KeyError:
        raise KeyError(f"no layer type {kind!r}; registered: {sorted(LAYER_TYPES)}") from None


def register(block: BlockType, mixer: str = "") -> None:
    """Add a kind of block: `block.kind` becomes a layer kind, and `block.symbol` places it in
    hybrid_layer_pattern; with `mixer` (an ssm_cfg.layer) the M blocks are of this kind when ssm_cfg.layer
    names that mixer."""
    if block.kind in LAYER_TYPES:
        raise ConfigError(f"layer type {block.kind!r} is registered already")
    if mixer:
        MIXER_KINDS[mixer] = block.kind
        LAYER_TYPES[block.kind] = block
        return
    if len(block.symbol) != 1 or block.symbol in PATTERN_SYMBOLS or block.symbol == "|":
        raise ConfigError(
            f"layer type {block.kind!r}: symbol {block.symbol!r} must be one character that neither another kind "
            f"nor '|' uses (taken: {sorted(PATTERN_SYMBOLS)})"
        )
    PATTERN_SYMBOLS[block.symbol] = block.kind
    LAYER_TYPES[block.kind] = block


for _block in (MAMBA_TYPE, ATTENTION_TYPE, MLP_TYPE, MOE_TYPE):
    register(_block)
register(MAMBA3_TYPE, mixer="Mamba3")
