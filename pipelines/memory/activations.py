"""An estimate of the activation memory of one pipeline stage's rank, from the shapes alone.

What autograd keeps per micro-batch on the accelerator's kernels is each layer type's `kept_bytes`
(`megamamba.model.layer_types`: a layer's input and what its kernels keep, at 2 bytes an element under
bf16 autocast, 4 without, the residual stream at 4, local widths under tensor parallelism); after the
head the loss keeps the logits (a*V), or under TP its float32 softmax (4*V), and the labels; a stage that
sends forward keeps its output stream until the backward. Under autocast each micro-batch in flight also
keeps bf16 copies of the Linear weights it used (`weight_elements`). A stage keeps `in_flight`
micro-batches (1F1B: pp - stage, at most the accumulation steps; one without a pipeline). With
recomputation every k layers only each run's input stream is kept, and one run is rebuilt at a time in
the backward. The backward adds the gradients of the largest layer's activations or the logits (and the
loss's float32 chunk, 128 MiB at most) for one micro-batch.
"""

from megamamba.model.chunked_cross_entropy import CHUNK_ELEMENTS
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import STREAM, RankShape
from megamamba.model.layers import layer_kinds


def _loss_bytes_per_token(shape: RankShape) -> int:
    """What the loss keeps per token: the logits (bf16 or float32) with the labels (int64) and logsumexp
    (float32), or under TP its float32 softmax with the labels and local labels (int64) and three masks."""
    if shape.tp > 1:
        return 4 * shape.local_vocab + 8 + 8 + 3
    return shape.act * shape.local_vocab + 8 + 4


_last_table: list = [None, None]  # a shape and its table: a plan asks once per stage


def _layer_table(shape: RankShape) -> tuple:
    """For every layer of the list: the bytes one micro-batch keeps, and the bytes of the bf16 weight copies
    autocast makes in one forward (the same on every stage of a plan, so the last table is kept)."""
    if _last_table[0] != shape:
        _last_table[:] = [shape, _table(shape)]
    return _last_table[1]


def _table(shape: RankShape) -> tuple:
    copy = 2 if shape.act == 2 else 0
    per_kind = {
        kind: (layer_type(kind).kept_bytes(shape), copy * layer_type(kind).weight_elements(shape))
        for kind in set(layer_kinds(shape.model))
    }
    kinds = layer_kinds(shape.model)
    return [per_kind[kind][0] for kind in kinds], [per_kind[kind][1] for kind in kinds]


def _runs(layers: range, checkpoint_interval: int) -> list:
    """The runs of layers recomputed together (one run of every layer without recomputation)."""
    k = checkpoint_interval or len(layers)
    return [range(s, min(s + k, layers.stop)) for s in range(layers.start, layers.stop, k)]


def kept_bytes(
    shape: RankShape, first_layer: int, stop_layer: int, last_layer: int, checkpoint_interval: int = 0
) -> int:
    """What one micro-batch in flight keeps until its backward on a stage of layers [first_layer, stop_layer) of
    a list that ends at `last_layer`, recomputing runs of `checkpoint_interval` layers (0: none)."""
    layers = range(first_layer, stop_layer)
    kept, copies = _layer_table(shape)
    stream = STREAM * shape.stream_width * shape.tokens
    sends = stop_layer <= last_layer
    loss = 0 if sends else _loss_bytes_per_token(shape) * shape.tokens
    output = stream if sends else 0  # kept until the next stage returns its gradient
    if checkpoint_interval:
        return sum(stream for run in _runs(layers, checkpoint_interval) if run[0] > 0) + loss + output
    return sum(kept[i] + copies[i] for i in layers) + loss + output


def stage_activation_bytes(
    shape: RankShape,
    first_layer: int,
    stop_layer: int,
    last_layer: int,
    checkpoint_interval: int = 0,
    in_flight: int = 1,
) -> int:
    """The estimated activation bytes of a rank whose stage runs layers [first_layer, stop_layer) with
    `in_flight` micro-batches: what they keep, one recomputed run, and the backward's largest gradient."""
    layers = range(first_layer, stop_layer)
    kept, copies = _layer_table(shape)
    rebuilt = 0
    if checkpoint_interval:
        rebuilt = max(sum(kept[i] + copies[i] for i in run) for run in _runs(layers, checkpoint_interval))
    loss = 0 if stop_layer <= last_layer else _loss_bytes_per_token(shape) * shape.tokens
    largest = max([kept[i] for i in layers] + [loss])
    chunk = 4 * min(shape.tokens, max(1, CHUNK_ELEMENTS // shape.local_vocab)) * shape.local_vocab
    backward = largest + (chunk if loss and shape.tp == 1 else 0)
    kept_in_flight = in_flight * kept_bytes(shape, first_layer, stop_layer, last_layer, checkpoint_interval)
    return kept_in_flight + rebuilt + backward
