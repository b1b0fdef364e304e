"""What one rank does for one micro-batch outside the layers' own work (each layer type's `work`,
`megamamba.model.layer_types`): the loss after the head, and what a pipeline stage sends the next.

Forward only; the step-time model derives the backward from each kernel kind's backward ratio (a kernel
run under `torch.utils.checkpoint` inside the layer runs its forward again in the backward).
tests/pipelines/planner/test_planner_collectives.py checks every collective against
`megamamba.parallel.comm_counter`.
"""

from megamamba.model.layer_types.costs import STREAM, Kernel, LayerWork, RankShape, pair


def _loss_collectives(shape: RankShape) -> tuple:
    """The vocab-parallel cross-entropy's float32 row maxima and (sum of exponentials, target logit); under
    context parallelism the counted tokens and the slices' sums of losses."""
    t = shape.tokens
    out = (
        pair("all_reduce", "", t * STREAM, "tp") + pair("all_reduce", "", 2 * t * STREAM, "tp") if shape.tp > 1 else ()
    )
    return out + (pair("all_reduce", "", STREAM, "cp") * 2 if shape.cp > 1 else ())


def loss_work(shape: RankShape) -> LayerWork:
    """The loss after the head, outside the layer list (never recomputed): float32 softmax and gradient."""
    return LayerWork(
        (Kernel("elementwise", 0, 2 * STREAM * shape.tokens * shape.local_vocab),), _loss_collectives(shape)
    )


def boundary_bytes(shape: RankShape) -> int:
    """What a pipeline stage sends the next per micro-batch (and receives back as its gradient)."""
    return shape.stream_tokens * shape.model.d_model * STREAM
