"""An estimate of the activation memory of one pipeline stage's rank, from the shapes alone.

What autograd keeps per token, on the accelerator's kernels (kernels/triton: each scan, conv and
norm keeps its inputs and recomputes the rest; Mamba-1's scan also keeps a float32 state every 16
steps), a = 2 bytes under bf16 autocast (4 without), r = 4 (the float32 residual stream), local
widths under tensor parallelism (d_inner / TP, heads / TP, vocabulary / TP):
  - a block: its input stream r*d (a shard of the sequence under sequence parallelism), the
    normed input as its first projection reads it a*d, then by its mixer:
    - Mamba: in_proj's output, the conv output, the scan's extra state and output, the gated
      norm's output (Mamba-2), and A = -exp(A_log) twice; Mamba-2 with its B/C groups replicated
      over TP (ngroups < TP, every published size) also its norm across the ranks' summed
      out_proj products and 1/rms and its concatenated in_proj and conv weights;
    - attention, on the GPU's fused kernels (flash / memory-efficient SDPA, FlexAttention for
      documents: no seqlen x seqlen scores or mask): in_proj's q, k, v (kept whole: v is a view),
      the rotated q and k (with rotary), the attention output and its float32 logsumexp per head,
      and each rotation's float32 cos and sin (per position); under context parallelism the keys
      and values gathered from every rank instead of the local k;
    - MLP: fc1's output (gated: with the SiLU's output and the product), or squared ReLU's two outputs;
    with mamba_ssm's d_intermediate also norm2's input stream r*d, its output a*d and an MLP;
  - the final norm: its input r*d; the head: its input a*d; the loss: the logits (a*V), or under
    TP its float32 softmax (4*V), and the labels;
  - a stage that sends forward keeps its output stream r*d until the backward.
Under autocast each micro-batch in flight also keeps bf16 copies of the Linear weights it used.
A stage keeps `in_flight` micro-batches (1F1B: pp - stage, at most the accumulation steps; one
without a pipeline). With recomputation every k layers only each run's input stream is kept,
and one run is rebuilt at a time in the backward. The backward adds the gradients of the largest
layer's activations or the logits (and the loss's float32 chunk, 128 MiB at most) for one micro-batch.
"""

import math
from dataclasses import dataclass, replace

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.model.chunked_cross_entropy import CHUNK_ELEMENTS
from megamamba.model.flops import mlp_fc1_width

STREAM = 4  # the residual stream between blocks is float32 (float32 parameters)
SCAN_CHECKPOINT_STEPS = 16  # Mamba-1's Triton scan keeps a float32 state every this many steps


@dataclass(frozen=True)
class ActivationShape:
    model: MambaConfig
    micro_batch_size: int
    seq_length: int
    tp: int = 1
    sequence_parallel: bool = False
    autocast: bool = False
    checkpoint_interval: int = 0
    in_flight: int = 1
    cp: int = 1  # context-parallel ranks; seq_length is this rank's slice

    @property
    def act(self) -> int:
        """Bytes of an activation element: bf16 under autocast, float32 otherwise."""
        return 2 if self.autocast else 4

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length

    @property
    def stream_width(self) -> int:
        """Per-token width of the stream a rank holds: d_model, or its sequence share under SP."""
        return self.model.d_model // self.tp if self.sequence_parallel else self.model.d_model

    @property
    def local_vocab(self) -> int:
        return math.ceil(self.model.padded_vocab_size / self.tp)


def _mamba2_widths(shape: ActivationShape) -> tuple:
    """A Mamba-2 mixer's local (d_inner, nheads, ngroups x d_state, B/C replicated over TP)."""
    model, tp = shape.model, shape.tp
    opts = model.mixer_options
    groups = opts.ngroups * opts.d_state
    replicated = tp > 1 and opts.ngroups % tp != 0
    return model.d_inner // tp, model.nheads // tp, groups if replicated else groups // tp, replicated


def mixer_bytes_per_token(shape: ActivationShape) -> int:
    """What a Mamba mixer keeps per token, its input excluded."""
    model, a = shape.model, shape.act
    opts = model.mixer_options
    d = model.d_model
    if isinstance(opts, Mamba1Options):
        d_inner = model.d_inner // shape.tp
        x_proj_out = model.dt_rank + 2 * opts.d_state
        # normed input, in_proj out (x, z), conv out, x_proj out, delta, scan out (its states: _scan_state_bytes)
        return a * (d + 2 * d_inner + d_inner + x_proj_out + d_inner + d_inner)
    d_inner, nheads, bc, replicated = _mamba2_widths(shape)
    in_proj_out = 2 * d_inner + 2 * bc + nheads
    conv_out = d_inner + 2 * bc
    norm_out = d_inner if opts.rmsnorm else 0
    kept = a * (d + in_proj_out + conv_out + d_inner + norm_out)
    if replicated and opts.rmsnorm:  # the norm spans ranks (parallel.tensor.spanning_norm): per group the summed
        # out_proj products and 1/rms (float32, and its bf16 copy under autocast), of this rank's sequence
        # shard under sequence parallelism
        per_group = a * d + 4 + (2 if shape.autocast else 0)
        kept += opts.ngroups * per_group // (shape.tp if shape.sequence_parallel else 1)
    return kept


def _attention_widths(shape: ActivationShape) -> tuple:
    """An attention mixer's local (query heads, key/value heads computed by in_proj, key/value heads read,
    head_dim): key/value heads split over TP, or all computed and one read when there are fewer than TP."""
    model, tp = shape.model, shape.tp
    options = model.attention_options
    kv = options.kv_heads
    computed = kv // tp if kv % tp == 0 else kv
    return options.num_heads // tp, computed, kv // tp if kv % tp == 0 else 1, model.head_dim_of(options)


def attention_bytes_per_token(shape: ActivationShape) -> int:
    """What an attention mixer keeps per token on the GPU's fused kernels, its input excluded."""
    a = shape.act
    heads, computed, read, head_dim = _attention_widths(shape)
    rotary = shape.model.attention_options.rotary_emb_dim > 0
    qkv = (heads + 2 * computed) * head_dim
    kept = a * (shape.model.d_model + heads * head_dim) + 4 * heads  # normed input, output, logsumexp
    if shape.cp > 1:  # the whole sequence's k and v gathered, and q: rotated, or a view of qkv
        return kept + a * 2 * read * head_dim * shape.cp + a * (heads * head_dim if rotary else qkv)
    return kept + a * qkv + (a * (heads + read) * head_dim if rotary else 0)  # qkv (v is a view), rotated q, k


def mlp_bytes_per_token(shape: ActivationShape) -> int:
    """What an MLP keeps per token, its input excluded: fc1's output, the SiLU's and the product (gated), or
    ReLU's and its square's."""
    hidden = shape.model.mlp_width // shape.tp
    return shape.act * (4 if shape.model.mlp_activation == "gated_silu" else 2) * hidden


def block_bytes_per_token(shape: ActivationShape, kind: str) -> int:
    """What a block of `kind` keeps per token: its input stream, its mixer's, and the MLP inside it (with norm2)."""
    stream = STREAM * shape.stream_width
    normed = shape.act * shape.model.d_model
    if kind == "mamba":
        kept = mixer_bytes_per_token(shape)
    elif kind == "attention":
        kept = attention_bytes_per_token(shape)
    else:
        kept = normed + mlp_bytes_per_token(shape)
    if shape.model.mlp_inside_blocks:
        kept += stream + normed + mlp_bytes_per_token(shape)
    return stream + kept


def _scan_state_bytes(shape: ActivationShape, kind: str) -> int:
    """Mamba-1's Triton scan keeps the float32 state entering each of a sequence's chunks: a whole chunk's for a
    sequence that ends inside one."""
    opts = shape.model.mixer_options
    if kind != "mamba" or not isinstance(opts, Mamba1Options):
        return 0
    chunks = math.ceil(shape.seq_length / SCAN_CHECKPOINT_STEPS)
    return STREAM * shape.micro_batch_size * chunks * (shape.model.d_inner // shape.tp) * opts.d_state


def _block_constant_bytes(shape: ActivationShape, kind: str) -> int:
    """What a block keeps whatever the batch: for Mamba A = -exp(A_log) twice (float32), and with Mamba-2's B/C
    replicated over TP the concatenated conv weight and bias, and in float32 the concatenated in_proj weight;
    for attention with rotary the cos and sin of q's and of k's rotation (float32, per position), and with its
    key/value heads replicated over TP (fewer than TP) in float32 the concatenated in_proj weight."""
    model, opts = shape.model, shape.model.mixer_options
    if kind == "attention":
        kept = 2 * 2 * 4 * shape.seq_length * (model.attention_options.rotary_emb_dim // 2)
        heads, computed, _, head_dim = _attention_widths(shape)
        if model.attention_options.kv_heads % shape.tp and not shape.autocast:
            kept += 4 * (heads + 2 * computed) * head_dim * model.d_model
        return kept
    if kind == "mlp":
        return 0
    if isinstance(opts, Mamba1Options):
        return 2 * 4 * model.d_inner * opts.d_state // shape.tp
    d_inner, nheads, bc, replicated = _mamba2_widths(shape)
    kept = 2 * 4 * nheads
    if replicated:
        conv_dim = d_inner + 2 * bc
        kept += 4 * conv_dim * (opts.d_conv + (1 if opts.conv_bias else 0))
        if not shape.autocast:
            kept += 4 * (2 * d_inner + 2 * bc + nheads) * (model.d_model + (1 if opts.bias else 0))
    return kept


def _mlp_weights(shape: ActivationShape) -> int:
    """Elements of an MLP's fc1 and fc2 weights on a TP rank."""
    model = shape.model
    fc1 = mlp_fc1_width(model) // shape.tp
    return (fc1 + model.mlp_width // shape.tp) * model.d_model


def _linear_weights_per_block(shape: ActivationShape, kind: str) -> int:
    """Elements of the Linear weights a block of `kind` multiplies with (their bf16 copies under autocast)."""
    model = shape.model
    opts = model.mixer_options
    d = model.d_model
    inside = _mlp_weights(shape) if model.mlp_inside_blocks else 0
    if kind == "mlp":
        return _mlp_weights(shape)
    if kind == "attention":
        heads, computed, _, head_dim = _attention_widths(shape)
        return (heads + 2 * computed) * head_dim * d + heads * head_dim * d + inside
    if isinstance(opts, Mamba1Options):
        d_inner = model.d_inner // shape.tp
        return (
            d * 2 * d_inner
            + d_inner * (model.dt_rank + 2 * opts.d_state)
            + model.dt_rank * d_inner
            + d_inner * d
            + inside
        )
    d_inner, nheads, bc, _ = _mamba2_widths(shape)
    return d * (2 * d_inner + 2 * bc + nheads) + d_inner * d + inside


def _loss_bytes_per_token(shape: ActivationShape) -> int:
    """What the loss keeps per token: the logits (bf16 or float32) with the labels (int64) and logsumexp
    (float32), or under TP its float32 softmax with the labels and local labels (int64) and three masks."""
    if shape.tp > 1:
        return 4 * shape.local_vocab + 8 + 8 + 3
    return shape.act * shape.local_vocab + 8 + 4


_last_table = [None, None]  # (shape without in_flight, last_layer) and its table: a plan asks once per stage


def _per_layer(shape: ActivationShape, last_layer: int) -> tuple:
    """For every layer 0 .. last_layer (0 embedding, blocks, last_layer - 1 final norm, last_layer head): the bytes
    one micro-batch keeps, and the bytes of the bf16 weight copies autocast makes in one forward (the same on
    every stage of a plan, so the last table is kept)."""
    key = (replace(shape, in_flight=1), last_layer)
    if _last_table[0] != key:
        _last_table[:] = [key, _layer_table(key[0], last_layer)]
    return _last_table[1]


def _layer_table(shape: ActivationShape, last_layer: int) -> tuple:
    copy = 2 if shape.autocast else 0
    blocks = {
        kind: (
            block_bytes_per_token(shape, kind) * shape.tokens
            + _scan_state_bytes(shape, kind)
            + _block_constant_bytes(shape, kind),
            copy * _linear_weights_per_block(shape, kind),
        )
        for kind in set(shape.model.block_kinds)
    }
    kept, copies = [0], [0]  # the embedding's output is the next layer's input
    for kind in shape.model.block_kinds:
        kept.append(blocks[kind][0])
        copies.append(blocks[kind][1])
    kept += [STREAM * shape.stream_width * shape.tokens, shape.act * shape.model.d_model * shape.tokens]
    copies += [0, copy * shape.local_vocab * shape.model.d_model]
    return kept, copies


def _runs(shape: ActivationShape, layers: range) -> list:
    """The runs of layers recomputed together (one run of every layer without recomputation)."""
    k = shape.checkpoint_interval or len(layers)
    return [range(s, min(s + k, layers.stop)) for s in range(layers.start, layers.stop, k)]


def _kept(shape: ActivationShape, table: tuple, first_layer: int, stop_layer: int, last_layer: int) -> int:
    layers = range(first_layer, stop_layer)
    kept, copies = table
    stream = STREAM * shape.stream_width * shape.tokens
    sends = stop_layer <= last_layer
    loss = 0 if sends else _loss_bytes_per_token(shape) * shape.tokens
    output = stream if sends else 0  # kept until the next stage returns its gradient
    if shape.checkpoint_interval:
        return sum(stream for run in _runs(shape, layers) if run[0] > 0) + loss + output
    return sum(kept[i] + copies[i] for i in layers) + loss + output


def kept_bytes(shape: ActivationShape, first_layer: int, stop_layer: int, last_layer: int) -> int:
    """What one micro-batch in flight keeps until its backward on a stage of layers [first_layer, stop_layer)."""
    return _kept(shape, _per_layer(shape, last_layer), first_layer, stop_layer, last_layer)


def stage_activation_bytes(shape: ActivationShape, first_layer: int, stop_layer: int, last_layer: int) -> int:
    """The estimated activation bytes of a rank whose stage runs layers [first_layer, stop_layer): what the
    micro-batches in flight keep, one recomputed run, and the backward's largest gradient."""
    layers = range(first_layer, stop_layer)
    table = _per_layer(shape, last_layer)
    kept, copies = table
    rebuilt = 0
    if shape.checkpoint_interval:
        rebuilt = max(sum(kept[i] + copies[i] for i in run) for run in _runs(shape, layers))
    loss = 0 if stop_layer <= last_layer else _loss_bytes_per_token(shape) * shape.tokens
    largest = max([kept[i] for i in layers] + [loss])
    chunk = 4 * min(shape.tokens, max(1, CHUNK_ELEMENTS // shape.local_vocab)) * shape.local_vocab
    backward = largest + (chunk if loss and shape.tp == 1 else 0)
    return shape.in_flight * _kept(shape, table, first_layer, stop_layer, last_layer) + rebuilt + backward
