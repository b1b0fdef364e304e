"""An attention block: the pre-norm residual block around causal self-attention (pattern symbol *), and what
the framework knows of it (`AttentionType`)."""

from typing import Optional

import torch

from megamamba.config import ATTENTION_LETTER, MambaConfig
from megamamba.model.attention import Attention
from megamamba.model.block import Block
from megamamba.model.causal_attention import causal_attention
from megamamba.model.layer_types.base import BlockType
from megamamba.model.layer_types.costs import (
    Kernel,
    LayerWork,
    RankShape,
    activation_bytes,
    matmul,
    norm,
    pair,
    replicated_gradients,
    tp_reductions,
)
from megamamba.model.layer_types.mlp import MLP_TYPE
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.model_layout import check_attention_layout


class AttentionBlock(Block):
    """A block whose mixer is causal self-attention (attn_cfg); attn_layer_idx, or pattern symbol *."""

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
            lambda: Attention(config.d_model, config.attention_options, device=device, dtype=dtype, tp=tp, cp=cp),
            tp,
            device,
            dtype,
        )


def attention_projection_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of an attention mixer's in_proj (q, k, v) and out_proj."""
    o = config.attention_options
    head_dim = config.head_dim_of(o)
    return 2 * config.d_model * (o.num_heads + 2 * o.kv_heads) * head_dim + 2 * o.num_heads * head_dim * config.d_model


def attention_core_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of QK^T and AV under the causal mask: s/2 keys per query on average."""
    o = config.attention_options
    return 2 * 2 * o.num_heads * config.head_dim_of(o) * seq_length // 2


def _widths(shape: RankShape) -> tuple:
    """A rank's (query heads, key/value heads computed by in_proj, key/value heads read, head_dim): key/value
    heads split over TP, or all computed and one read when there are fewer than TP."""
    model, tp = shape.model, shape.tp
    options = model.attention_options
    kv = options.kv_heads
    computed = kv // tp if kv % tp == 0 else kv
    return options.num_heads // tp, computed, kv // tp if kv % tp == 0 else 1, model.head_dim_of(options)


def causal_pairs(shape: RankShape) -> int:
    """(query, key) pairs of one sequence on the busiest context-parallel rank (the last slice sees every key)."""
    width = shape.slice_length
    return width * width * (shape.cp - 1) + width * (width + 1) // 2


class AttentionType(BlockType):
    """The attention block, on the GPU's fused kernels (flash / memory-efficient SDPA, FlexAttention for
    documents: no seqlen x seqlen scores or mask).

    Kept for the backward per token: the normed input, in_proj's q, k, v (kept whole: v is a view), the
    rotated q and k (with rotary), the output and its float32 logsumexp per head; under context parallelism
    the keys and values gathered from every rank instead of the local k. Per position: each rotation's
    float32 cos and sin."""

    kind, symbol, block_class = "attention", ATTENTION_LETTER, AttentionBlock
    inner_mlp = MLP_TYPE

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        check_attention_layout(config.attention_options, tp_size)

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return attention_projection_flops(config) + attention_core_flops(config, seq_length)

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        model, a = shape.model, shape.act
        options = model.attention_options
        heads, computed, read, head_dim = _widths(shape)
        rotary = options.rotary_emb_dim > 0
        qkv = (heads + 2 * computed) * head_dim
        per_token = a * (model.d_model + heads * head_dim) + 4 * heads  # normed input, output, logsumexp
        if shape.cp > 1:  # the whole sequence's k and v gathered, and q: rotated, or a view of qkv
            per_token += a * 2 * read * head_dim * shape.cp + a * (heads * head_dim if rotary else qkv)
        else:  # qkv (v is a view), rotated q, k
            per_token += a * qkv + (a * (heads + read) * head_dim if rotary else 0)
        constant = 2 * 2 * 4 * shape.slice_length * (options.rotary_emb_dim // 2)
        if options.kv_heads % shape.tp and a == 4:  # in float32 the concatenated in_proj weight
            constant += 4 * qkv * model.d_model
        return per_token * shape.tokens + constant

    def mixer_weight_elements(self, shape: RankShape) -> int:
        heads, computed, _, head_dim = _widths(shape)
        return (heads + 2 * computed) * head_dim * shape.model.d_model + heads * head_dim * shape.model.d_model

    def mixer_work(self, shape: RankShape) -> LayerWork:
        model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
        o = model.attention_options
        d = model.d_model
        heads, projected, kv, hd = _widths(shape)
        pairs = shape.micro_batch_size * causal_pairs(shape)
        in_proj = matmul(shape, d, (heads + 2 * projected) * hd)
        kernels = [norm(shape), in_proj]
        if o.rotary_emb_dim:
            kernels.append(Kernel("elementwise", 0, 2 * a * t * (heads + kv) * o.rotary_emb_dim))
        keys = t * shape.cp  # the whole sequence's keys under context parallelism
        kernels += [
            Kernel("attention", 4 * hd * heads * pairs, a * hd * (2 * t * heads + 2 * keys * kv)),
            matmul(shape, heads * hd, d),
        ]
        collectives = tp_reductions(shape, in_proj, o.out_proj_bias)
        if o.kv_heads % tp:  # the key/value rows of in_proj, replicated
            rows = 2 * o.kv_heads * hd
            collectives += replicated_gradients(shape, rows * d, rows * o.qkv_proj_bias)
        if shape.cp > 1:
            collectives += pair("all_gather", "reduce_scatter", keys * 2 * kv * hd * a, "cp")
        return LayerWork(tuple(kernels), collectives)

    def kernel_benchmarks(self, config: MambaConfig, batch: int, seq_length: int, device, dtype) -> dict:
        attention = config.attention_options
        hd = config.head_dim_of(attention)
        shape = RankShape(config, batch, seq_length, act=activation_bytes(dtype))
        counted = self.mixer_work(shape).kernel("attention")
        inputs = [
            torch.randn(batch, seq_length, heads, hd, device=device, dtype=dtype) * 0.5
            for heads in (attention.num_heads, attention.kv_heads, attention.kv_heads)
        ]
        return {"attention": (lambda q, k, v: causal_attention(q, k, v, attention.softmax_scale), inputs, counted)}


ATTENTION_TYPE = AttentionType()
