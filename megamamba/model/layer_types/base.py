"""What the framework knows of a kind of layer, stated once, in the kind's own module.

The FLOPs count and MFU (`megamamba.model.flops`), the memory plan's activation estimate, the planner's
kernels and collectives, the layout checks, initialisation, the checkpoint's mamba_ssm names and the run's
console all read a layer's kind through its `LayerType` and never branch on its name. A new kind subclasses
`LayerType` (a block: `BlockType`) and is registered with `megamamba.model.layer_types.register`.
"""

import math
from typing import Optional, cast

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.block import Block
from megamamba.model.initialisation import redraw, zero_biases
from megamamba.model.layer_types.costs import STREAM, LayerWork, RankShape
from megamamba.parallel import TensorParallel


class LayerType:
    """One kind of layer of the list. `kind` names it in the layer numbering, profiles and logs; `symbol` is
    its letter in hybrid_layer_pattern (blocks only)."""

    kind = ""
    symbol = ""
    drawn_whole = False  # under TP its constructor draws the full tensors, as one device would, then keeps its rows
    holds_experts = False  # its constructor takes the expert-parallel group, `ep=`

    def layer_class(self, config: MambaConfig, tp: Optional[TensorParallel]) -> type:
        """The module class of a layer of this kind, built as `cls(config, tp=, cp=)` (its TP form under `tp`)."""
        raise NotImplementedError

    def initialise(self, layer: nn.Module, config: MambaConfig, tp: Optional[TensorParallel]) -> None:
        """mamba_ssm's `_init_weights` for a layer of this kind, after its constructor's draws (default: none)."""

    def state_prefix(self, index: int) -> str:
        """The mamba_ssm name prefix of the parameters of layer `index` of the list, one of this kind."""
        raise NotImplementedError

    def holds(self, key: str) -> bool:
        """Whether `key` (a name after the prefix) can be one of its parameters."""
        return key == "weight"

    def tied(self, config: MambaConfig) -> bool:
        """Whether it reads another layer's weight (the head under tie_embeddings)."""
        return False

    def label(self, config: MambaConfig) -> str:
        """Its name in the run's console."""
        return self.kind

    def check_layout(self, config: MambaConfig, tp_size: int) -> None:
        """Refuse (LayoutError) a config whose layers of this kind cannot be split across `tp_size` ranks."""

    def conv_width(self, config: MambaConfig) -> int:
        """The width of the causal conv it runs along the sequence, whose width - 1 last tokens a context-parallel
        slice hands the next (1: none)."""
        return 1

    def flops_per_token(self, config: MambaConfig, seq_length: int) -> int:
        """Forward FLOPs per token at sequence length `seq_length`, a multiply-add as 2 (docs/code.md)."""
        raise NotImplementedError

    def kept_bytes(self, shape: RankShape) -> int:
        """What one micro-batch keeps for the backward, its input included (the previous layer's output)."""
        raise NotImplementedError

    def weight_elements(self, shape: RankShape) -> int:
        """Elements of the Linear weights it multiplies with on a rank (their bf16 copies under autocast)."""
        return 0

    def work(self, shape: RankShape) -> LayerWork:
        """Its forward kernels and collectives on a rank for one micro-batch."""
        raise NotImplementedError

    def example_input(self, config: MambaConfig, batch: int, seq_length: int, device) -> torch.Tensor:
        """An input to time it on: its `Stream`'s hidden tensor."""
        return torch.randn(batch, seq_length, config.d_model, device=device)

    def kernel_benchmarks(self, config: MambaConfig, batch: int, seq_length: int, device, dtype) -> dict:
        """Profile kernel kind -> (op, inputs) for its own kernels at one layer's shapes, for calibration."""
        return {}


class BlockType(LayerType):
    """A pre-norm residual block (`megamamba.model.block.Block`): its input stream, its mixer's costs
    (`mixer_*`, the pre-norm included), and with mamba_ssm's d_intermediate the MLP inside it (`inner_mlp`)."""

    block_class: type = object
    inner_mlp: Optional["BlockType"] = None

    def layer_class(self, config: MambaConfig, tp: Optional[TensorParallel]) -> type:
        return self.block_class

    def initialise(self, layer: nn.Module, config: MambaConfig, tp: Optional[TensorParallel]) -> None:
        """Linear biases zeroed, and the projections back onto the stream redrawn scaled by 1 / sqrt(n_layer)
        (MambaLMHeadModel's last pass)."""
        zero_biases(layer)
        for projection in cast(Block, layer).output_projections():
            redraw(
                projection.weight,
                (projection.out_features, projection.in_features),
                lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)).div_(math.sqrt(config.n_layer)),
                tp,
            )

    def state_prefix(self, index: int) -> str:
        return f"backbone.layers.{index - 1}."  # block i is layer i + 1

    def holds(self, key: str) -> bool:
        return bool(key)  # any parameter of the block

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        """Refuse (LayoutError) a mixer of this kind that cannot be split across `tp_size` ranks."""

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        raise NotImplementedError

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        raise NotImplementedError

    def mixer_weight_elements(self, shape: RankShape) -> int:
        raise NotImplementedError

    def mixer_work(self, shape: RankShape) -> LayerWork:
        raise NotImplementedError

    def _inner(self, config: MambaConfig) -> Optional["BlockType"]:
        return self.inner_mlp if config.mlp_inside_blocks else None

    def check_layout(self, config: MambaConfig, tp_size: int) -> None:
        self.check_mixer_layout(config, tp_size)
        inner = self._inner(config)
        if inner:
            inner.check_mixer_layout(config, tp_size)

    def flops_per_token(self, config: MambaConfig, seq_length: int) -> int:
        inner = self._inner(config)
        return self.mixer_flops(config, seq_length) + (inner.mixer_flops(config, seq_length) if inner else 0)

    def kept_bytes(self, shape: RankShape) -> int:
        stream = STREAM * shape.stream_width * shape.tokens
        inner = self._inner(shape.model)
        return stream + self.mixer_kept_bytes(shape) + (stream + inner.mixer_kept_bytes(shape) if inner else 0)

    def weight_elements(self, shape: RankShape) -> int:
        inner = self._inner(shape.model)
        return self.mixer_weight_elements(shape) + (inner.mixer_weight_elements(shape) if inner else 0)

    def work(self, shape: RankShape) -> LayerWork:
        inner = self._inner(shape.model)
        return self.mixer_work(shape) + inner.mixer_work(shape) if inner else self.mixer_work(shape)
