"""A Mamba-3 block: the pre-norm residual block around a Mamba-3 mixer, and what the framework knows of it
(`Mamba3Type`). Pattern letter M when ssm_cfg.layer is "Mamba3" (`register(..., mixer="Mamba3")`)."""

from typing import Optional

from megamamba.config import MAMBA_LETTER, Mamba3Options, MambaConfig
from megamamba.model.block import Block
from megamamba.model.layer_types.base import BlockType
from megamamba.model.layer_types.costs import (
    STREAM,
    Kernel,
    LayerWork,
    RankShape,
    matmul,
    norm,
    pair,
    replicated_gradients,
    tp_reductions,
)
from megamamba.model.layer_types.mlp import MLP_TYPE
from megamamba.model.mamba3 import Mamba3, check_mamba3_layout
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel


def _options(config: MambaConfig) -> Mamba3Options:
    options = config.mixer_options
    if not isinstance(options, Mamba3Options):
        raise ValueError(f"ssm_cfg.layer={config.layer!r}: Mamba-3's description needs a Mamba3 mixer")
    return options


class Mamba3Block(Block):
    """A block whose mixer is Mamba-3."""

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
            lambda: Mamba3(config.d_model, _options(config), device=device, dtype=dtype, tp=tp, cp=cp),
            tp,
            device,
            dtype,
        )


def _bc_replicated(config: MambaConfig, tp: int) -> bool:
    """Whether every TP rank computes B/C whole: where ngroups does not divide TP."""
    return tp > 1 and _options(config).ngroups % tp != 0


def in_proj_width(config: MambaConfig, tp: int = 1) -> int:
    """in_proj's output columns on one of `tp` ranks: z, x (d_inner each), B, C (ngroups x rank x d_state each;
    split by group, or whole where B/C are replicated), dd_dt, dd_A, trap (nheads each) split with the heads;
    the angles whole."""
    o = _options(config)
    bc = o.ngroups * o.rank * o.d_state
    bc_here = bc if _bc_replicated(config, tp) else bc // tp
    return 2 * (config.d_inner // tp) + 2 * bc_here + 3 * (config.nheads // tp) + o.num_rope_angles


def mamba3_scan_flops(tokens: int, seq_length: int, config: MambaConfig) -> int:
    """The chunked scan, forward, as a kernel runs it: per head and token, the chunk's Q x rank rows of
    scores against Q x rank keys (the trapezoid's previous-token term folded into one key per token) times
    d_state, their product with the values (headdim), and the chunk state in and out (2 d_state headdim
    per rank each); Q = min(chunk_size, seq_length)."""
    o = _options(config)
    q, r, n, p = min(o.chunk_size, seq_length), o.rank, o.d_state, o.headdim
    return tokens * config.nheads * (2 * q * r * r * (n + p) + 4 * r * n * p)


def mamba3_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one Mamba-3 mixer at sequence length `seq_length`."""
    projections = 2 * config.d_model * in_proj_width(config) + 2 * config.d_inner * config.d_model
    return projections + mamba3_scan_flops(1, seq_length, config)


def _widths(shape: RankShape) -> tuple:
    """A rank's (d_inner, nheads, in_proj columns, B/C replicated over TP)."""
    model, tp = shape.model, shape.tp
    return model.d_inner // tp, model.nheads // tp, in_proj_width(model, tp), _bc_replicated(model, tp)


def _kept_bytes(shape: RankShape) -> int:
    """The normed input, in_proj's output, the scan's output per rank and the gated output; B̂ and Ĉ, Δ, A, λ
    and the angle in float32 (what the fused kernels keep); a rank's share of each under TP."""
    model, a = shape.model, shape.act
    o = _options(model)
    d_inner, h, in_proj, _ = _widths(shape)
    per_token = a * (model.d_model + in_proj + (o.rank + 1) * d_inner)
    per_token += STREAM * (2 * h * o.rank * o.d_state + 3 * h + h * o.num_rope_angles)
    return per_token * shape.tokens


def _state_passing(shape: RankShape, nheads: int) -> tuple:
    """Context parallelism (`megamamba.parallel.context.mamba3_slice`): the all-gather of every slice's angle
    (its document mask and last angle) and, of the previous rank's last token, the x and B̂ halo forward;
    the all-gather of the SSM state summaries (decay, state); each with its adjoint backward."""
    if shape.cp == 1:
        return ()
    o, mb = _options(shape.model), shape.micro_batch_size
    angles = shape.cp * mb * (1 + nheads * o.num_rope_angles) * STREAM
    halo = mb * nheads * o.rank * (o.headdim + o.d_state) * STREAM
    states = shape.cp * mb * (nheads + nheads * o.headdim * o.d_state) * STREAM
    return (
        pair("all_gather", "reduce_scatter", angles, "cp")
        + pair("send", "send", halo, "cp")
        + pair("all_gather", "reduce_scatter", states, "cp")
    )


def _work(shape: RankShape) -> LayerWork:
    model, t, a = shape.model, shape.tokens, shape.act
    o = _options(model)
    di, h, columns, replicated = _widths(shape)
    r, n = o.rank, o.d_state
    in_proj = matmul(shape, model.d_model, columns)
    scan_bytes = a * t * (2 * r * di + 2 * h * r * n + 3 * h + o.num_rope_angles)
    kernels: tuple = (
        norm(shape),
        in_proj,
        Kernel("ssd", mamba3_scan_flops(t, shape.slice_length, model) // shape.tp, scan_bytes),
        Kernel("norm", 0, 3 * a * t * di),
        matmul(shape, di, model.d_model),
    )
    if shape.cp > 1:  # the entering state's contribution Ĉ h0 exp(cumsum ΔA): a float32 einsum
        entering = Kernel("matmul_fp32", 2 * t * r * di * n, STREAM * t * (2 * r * di + h * r * n), checkpointed=True)
        kernels += (entering,)
    # in_proj's whole rows (the angles', and B/C's when replicated) and the B/C norms: gradients summed over TP
    whole_rows = o.num_rope_angles + (2 * r * o.ngroups * n if replicated else 0)
    collectives = tp_reductions(shape, in_proj) + replicated_gradients(shape, whole_rows * model.d_model, n, n)
    return LayerWork(kernels, collectives + _state_passing(shape, h))


class Mamba3Type(BlockType):
    """The Mamba-3 block (M when ssm_cfg.layer is "Mamba3"): its heads split over TP, its sequence over CP."""

    kind, symbol, block_class = "mamba3", MAMBA_LETTER, Mamba3Block
    inner_mlp = MLP_TYPE

    def label(self, config: MambaConfig) -> str:
        return config.layer

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        check_mamba3_layout(config.d_model, _options(config), tp_size)

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return mamba3_layer_flops(config, seq_length)

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        return _kept_bytes(shape)

    def mixer_weight_elements(self, shape: RankShape) -> int:
        d_inner, _, in_proj, _ = _widths(shape)
        return shape.model.d_model * in_proj + d_inner * shape.model.d_model

    def mixer_work(self, shape: RankShape) -> LayerWork:
        return _work(shape)


MAMBA3_TYPE = Mamba3Type()
