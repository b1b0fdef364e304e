"""An estimate of the activation memory of one pipeline stage's rank, from the shapes alone.

What autograd keeps per token, on the accelerator's kernels (kernels/triton: each scan, conv and
norm keeps its inputs and recomputes the rest; Mamba-1's scan also keeps a float32 state every 16
steps), a = 2 bytes under bf16 autocast (4 without), r = 4 (the float32 residual stream), local
widths under tensor parallelism (d_inner / TP, heads / TP, vocabulary / TP):
  - a block: its input stream r*d (a shard of the sequence under sequence parallelism), the
    normed input as in_proj reads it a*d, in_proj's output, the conv output, the scan's extra
    state and output, the gated norm's output (Mamba-2), and A = -exp(A_log) twice; Mamba-2 with
    its B/C groups replicated over TP (ngroups < TP, every published size) also its norm across
    the ranks' summed out_proj products and 1/rms and its concatenated in_proj and conv weights;
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
from dataclasses import dataclass

from megamamba.config import Mamba1Options, MambaConfig
from megamamba.model.chunked_cross_entropy import CHUNK_ELEMENTS

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
    """What a mixer keeps per token, its input excluded."""
    model, a = shape.model, shape.act
    opts = model.mixer_options
    d = model.d_model
    if isinstance(opts, Mamba1Options):
        d_inner = model.d_inner // shape.tp
        x_proj_out = model.dt_rank + 2 * opts.d_state
        scan_states = STREAM * d_inner * opts.d_state // SCAN_CHECKPOINT_STEPS
        # normed input, in_proj out (x, z), conv out, x_proj out, delta, scan states, scan out
        return a * (d + 2 * d_inner + d_inner + x_proj_out + d_inner + d_inner) + scan_states
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


def _block_constant_bytes(shape: ActivationShape) -> int:
    """What a block keeps whatever the tokens: A = -exp(A_log) twice (float32), and with Mamba-2's B/C
    replicated over TP the concatenated conv weight and bias, and in float32 the concatenated in_proj weight."""
    model, opts = shape.model, shape.model.mixer_options
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


def _linear_weights_per_block(shape: ActivationShape) -> int:
    """Elements of the Linear weights a block multiplies with (their bf16 copies under autocast)."""
    model = shape.model
    opts = model.mixer_options
    d = model.d_model
    if isinstance(opts, Mamba1Options):
        d_inner = model.d_inner // shape.tp
        return d * 2 * d_inner + d_inner * (model.dt_rank + 2 * opts.d_state) + model.dt_rank * d_inner + d_inner * d
    d_inner, nheads, bc, _ = _mamba2_widths(shape)
    return d * (2 * d_inner + 2 * bc + nheads) + d_inner * d


def _layer_bytes_per_token(shape: ActivationShape, layer: int, last_layer: int) -> int:
    """Bytes kept per token by pipeline layer `layer` (0 embedding, blocks, final norm, last_layer head)."""
    stream = STREAM * shape.stream_width
    if layer == 0:
        return 0  # its output is the next layer's input
    if layer < last_layer - 1:
        return stream + mixer_bytes_per_token(shape)
    if layer == last_layer - 1:
        return stream
    return shape.act * shape.model.d_model


def _loss_bytes_per_token(shape: ActivationShape) -> int:
    """What the loss keeps per token: the logits (bf16 or float32) with the labels (int64) and logsumexp
    (float32), or under TP its float32 softmax with the labels and local labels (int64) and three masks."""
    if shape.tp > 1:
        return 4 * shape.local_vocab + 8 + 8 + 3
    return shape.act * shape.local_vocab + 8 + 4


def _weight_copies(shape: ActivationShape, layers: range, last_layer: int) -> int:
    """Bytes of the bf16 weight copies autocast makes for `layers` in one forward (0 without autocast)."""
    if not shape.autocast:
        return 0
    blocks = sum(1 for i in layers if 0 < i < last_layer - 1)
    head = shape.local_vocab * shape.model.d_model if last_layer in layers else 0
    return 2 * (blocks * _linear_weights_per_block(shape) + head)


def _layer_bytes(shape: ActivationShape, layer: int, last_layer: int) -> int:
    """Bytes one micro-batch keeps for pipeline layer `layer`."""
    kept = _layer_bytes_per_token(shape, layer, last_layer) * shape.tokens
    return kept + (_block_constant_bytes(shape) if 0 < layer < last_layer - 1 else 0)


def _runs(shape: ActivationShape, layers: range) -> list:
    """The runs of layers recomputed together (one run of every layer without recomputation)."""
    k = shape.checkpoint_interval or len(layers)
    return [range(s, min(s + k, layers.stop)) for s in range(layers.start, layers.stop, k)]


def kept_bytes(shape: ActivationShape, first_layer: int, stop_layer: int, last_layer: int) -> int:
    """What one micro-batch in flight keeps until its backward on a stage of layers [first_layer, stop_layer)."""
    layers = range(first_layer, stop_layer)
    stream = STREAM * shape.stream_width * shape.tokens
    sends = stop_layer <= last_layer
    loss = 0 if sends else _loss_bytes_per_token(shape) * shape.tokens
    output = stream if sends else 0  # kept until the next stage returns its gradient
    if shape.checkpoint_interval:
        return sum(stream for run in _runs(shape, layers) if run[0] > 0) + loss + output
    return sum(_layer_bytes(shape, i, last_layer) for i in layers) + loss + output + \
        _weight_copies(shape, layers, last_layer)


def stage_activation_bytes(shape: ActivationShape, first_layer: int, stop_layer: int, last_layer: int) -> int:
    """The estimated activation bytes of a rank whose stage runs layers [first_layer, stop_layer): what the
    micro-batches in flight keep, one recomputed run, and the backward's largest gradient."""
    layers = range(first_layer, stop_layer)
    rebuilt = 0
    if shape.checkpoint_interval:
        rebuilt = max(sum(_layer_bytes(shape, i, last_layer) for i in run) + _weight_copies(shape, run, last_layer)
                      for run in _runs(shape, layers))
    loss = 0 if stop_layer <= last_layer else _loss_bytes_per_token(shape) * shape.tokens
    largest = max([_layer_bytes(shape, i, last_layer) for i in layers] + [loss])
    chunk = 4 * min(shape.tokens, max(1, CHUNK_ELEMENTS // shape.local_vocab)) * shape.local_vocab
    backward = largest + (chunk if loss and shape.tp == 1 else 0)
    return shape.in_flight * kept_bytes(shape, first_layer, stop_layer, last_layer) + rebuilt + backward
