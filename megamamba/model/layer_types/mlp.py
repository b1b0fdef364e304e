"""An MLP block: the pre-norm residual block around an MLP of d_intermediate channels (pattern symbol -),
and what the framework knows of it (`MLPType`)."""

from typing import Optional

from megamamba.config import MLP_LETTER, MambaConfig
from megamamba.model.block import Block
from megamamba.model.layer_types.base import BlockType
from megamamba.model.layer_types.costs import Kernel, LayerWork, RankShape, matmul, norm, tp_reductions
from megamamba.model.mlp import MLP
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.model_layout import check_mlp_layout


class MLPBlock(Block):
    """A block whose mixer is an MLP of d_intermediate channels (mlp_activation); pattern symbol -."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            config,
            lambda: MLP(config.d_model, config.mlp_width, config.mlp_activation, device=device, dtype=dtype, tp=tp),
            tp,
            device,
            dtype,
        )


def mlp_fc1_width(config: MambaConfig) -> int:
    """Output width of an MLP's fc1: twice `mlp_width` when gated (SiLU), the gate's half with the value's."""
    return 2 * config.mlp_width if config.mlp_activation == "gated_silu" else config.mlp_width


def mlp_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one MLP: fc1 and fc2."""
    return 2 * config.d_model * mlp_fc1_width(config) + 2 * config.mlp_width * config.d_model


class MLPType(BlockType):
    """The MLP block, and the MLP inside every block with mamba_ssm's d_intermediate.

    Kept for the backward per token: the normed input, fc1's output, the SiLU's output and the product
    (gated), or ReLU's output and its square."""

    kind, symbol, block_class = "mlp", MLP_LETTER, MLPBlock

    def label(self, config: MambaConfig) -> str:
        return "MLP"

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        check_mlp_layout(config.mlp_width, tp_size)

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return mlp_flops(config)

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        hidden = shape.model.mlp_width // shape.tp
        per_token = (
            shape.act * shape.model.d_model
            + shape.act * (4 if shape.model.mlp_activation == "gated_silu" else 2) * hidden
        )
        return per_token * shape.tokens

    def mixer_weight_elements(self, shape: RankShape) -> int:
        model = shape.model
        return (mlp_fc1_width(model) // shape.tp + model.mlp_width // shape.tp) * model.d_model

    def mixer_work(self, shape: RankShape) -> LayerWork:
        model, t, a = shape.model, shape.tokens, shape.act
        width = model.mlp_width // shape.tp
        gated = model.mlp_activation == "gated_silu"
        fc1 = matmul(shape, model.d_model, (2 if gated else 1) * width)
        kernels = (
            norm(shape),
            fc1,
            Kernel("elementwise", 0, (3 if gated else 2) * a * t * width),
            matmul(shape, width, model.d_model),
        )
        return LayerWork(kernels, tp_reductions(shape, fc1))


MLP_TYPE = MLPType()
