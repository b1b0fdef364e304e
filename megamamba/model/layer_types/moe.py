"""A mixture-of-experts block: the pre-norm residual block around `megamamba.model.moe.MoE` (pattern symbol E),
which hands its router's losses on with the stream, and what the framework knows of it (`MoEType`): FLOPs of
the active parameters only (the router, top_k routed experts and the shared expert), on one tensor-parallel rank.
Under tensor parallelism the mixer runs whole on every rank of the group (its experts are not tensor-split; with
sequence parallelism on the gathered sequence, each rank keeping its shard of the output); under expert
parallelism it holds its rank's share of the experts.
"""

import math
from typing import Optional, cast

from torch import nn

from megamamba.config import MOE_LETTER, MambaConfig, MoEOptions
from megamamba.model.block import Block
from megamamba.model.layer_types.base import BlockType
from megamamba.model.layer_types.costs import STREAM, Collective, Kernel, LayerWork, RankShape, matmul, norm
from megamamba.model.moe import MoE
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, gather_whole_sequence, scatter_to_sequence_region
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel


class MoEBlock(Block):
    """A block whose mixer is a mixture of experts (moe_cfg); pattern symbol E. The same on every tensor-parallel
    rank (under sequence parallelism on the whole sequence, gathered after the norm); its experts split over
    `ep`'s ranks; under `cp` on this rank's slice of the sequences, its router's losses this slice's share."""

    mixer: MoE

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
        ep: Optional[ExpertParallel] = None,
    ):
        super().__init__(
            config, lambda: MoE(config.d_model, config.moe_options, device, dtype, ep=ep, cp=cp), tp, device, dtype
        )
        self.sequence_tp = tp if tp is not None and tp.size > 1 and tp.sequence_parallel else None

    def forward(self, x: Stream, inference_state=None) -> Stream:
        """The stream -> the next stream, the router's losses added to those it carries."""
        normed, stream = self._norm(self.norm, x.hidden)
        if self.sequence_tp is not None:
            normed = gather_whole_sequence(normed, self.sequence_tp)
        out, aux_loss = self.mixer.routed(normed)
        if self.sequence_tp is not None:
            out = scatter_to_sequence_region(out, self.sequence_tp)
        return x.carrying(self._mlp(out + stream)).adding_loss(aux_loss)


def _widths(o: MoEOptions) -> tuple:
    """(up_proj's rows, the hidden width) of a routed expert and of the shared one."""
    factor = 2 if o.activation == "gated_silu" else 1
    shared = o.shared_expert_ffn_hidden_size
    return factor * o.ffn_hidden_size, o.ffn_hidden_size, factor * shared, shared


def moe_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one MoE mixer's active parameters: the router, top_k experts, the shared one."""
    o, d = config.moe_options, config.d_model
    up, hidden, shared_up, shared = _widths(o)
    return 2 * d * o.num_experts + o.top_k * 2 * d * (up + hidden) + 2 * d * (shared_up + shared)


class MoEType(BlockType):
    """The mixture-of-experts block.

    Kept for the backward per token: the normed input, the router's float32 logits and scores, and per routed
    copy (top_k of them) the permuted input, up_proj's output, the activation's outputs (as the MLP's), and
    down_proj's float32 output for the weighted sum; the shared expert's as an MLP's."""

    kind, symbol, block_class = "moe", MOE_LETTER, MoEBlock
    holds_experts = True

    def label(self, config: MambaConfig) -> str:
        return "MoE"

    def initialise(self, layer: nn.Module, config: MambaConfig, tp: Optional[TensorParallel]) -> None:
        """Every expert's down_proj and the shared expert's fc2 redrawn scaled by 1 / sqrt(n_layer), as the MLP's
        fc2 (mamba_ssm's last pass); the router and up_proj keep their nn.Linear draws."""
        moe = cast(MoEBlock, layer).mixer
        shared = [] if moe.shared_experts is None else [moe.shared_experts.fc2.weight]
        for weight in (*moe.experts.each_expert(moe.experts.down_proj), *shared):
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5)).div_(math.sqrt(config.n_layer))

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return moe_flops(config)

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        o, d, a = shape.model.moe_options, shape.model.d_model, shape.act
        up, hidden, shared_up, shared = _widths(o)
        activation = (4 if o.activation == "gated_silu" else 2) * a
        routed = a * (d + up) + activation * hidden + STREAM * d
        shared_expert = a * shared_up + activation * shared if shared else 0
        per_token = a * d + 2 * STREAM * o.num_experts + o.top_k * routed + shared_expert
        return per_token * shape.tokens

    def mixer_weight_elements(self, shape: RankShape) -> int:
        o, d = shape.model.moe_options, shape.model.d_model
        up, hidden, shared_up, shared = _widths(o)
        return o.num_experts * d * (up + hidden) + d * (shared_up + shared)

    def mixer_work(self, shape: RankShape) -> LayerWork:
        o, d, a, t = shape.model.moe_options, shape.model.d_model, shape.act, shape.tokens
        up, hidden, shared_up, shared = _widths(o)
        rows = o.top_k * t
        router = Kernel("matmul_fp32", 2 * t * d * o.num_experts, STREAM * (d * o.num_experts + t * d))
        kernels = [
            norm(shape),
            router,
            Kernel("elementwise", 0, a * 2 * rows * d),  # the permutation: the tokens' copies sorted by expert
            Kernel("matmul", 2 * rows * d * up, a * (o.num_experts * d * up + rows * (d + up))),
            Kernel("elementwise", 0, (3 if o.activation == "gated_silu" else 2) * a * rows * hidden),
            Kernel("matmul", 2 * rows * hidden * d, a * (o.num_experts * hidden * d + rows * (hidden + d))),
            Kernel("elementwise", 0, STREAM * (rows + t) * d),  # the weighted sum back per token
        ]
        if shared:
            kernels += [matmul(shape, d, shared_up), matmul(shape, shared, d)]
        collectives: tuple = ()
        if shape.sequence_parallel:  # the normed shards gathered; the output's gradient gathered in the backward
            gathered = a * t * d
            collectives += (Collective("all_gather", gathered, "tp"), Collective("all_gather", gathered, "tp", True))
        if shape.ep > 1:  # the per-expert counts, then the rows there and back; their gradients back and there
            rows_bytes = a * rows * d
            collectives += (
                Collective("all_to_all", 8 * o.num_experts, "ep"),
                *(Collective("all_to_all", rows_bytes, "ep") for _ in range(2)),
                *(Collective("all_to_all", rows_bytes, "ep", backward=True) for _ in range(2)),
            )
        return LayerWork(tuple(kernels), collectives)


MOE_TYPE = MoEType()
