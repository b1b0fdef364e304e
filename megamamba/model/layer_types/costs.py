"""The records a layer type's costs are written in, and the pieces every layer's costs share.

`RankShape` is what one rank holds of a micro-batch. A layer's forward work for it is a `LayerWork`:
kernels (FLOPs, bytes) and the collectives our layers issue (docs/code.md, docs/context-parallel.md)
with the `nbytes` `megamamba.parallel.comm_counter` counts. Sizes are a rank's: channels and heads
divided by TP (key/value heads and B/C groups kept whole where they are replicated), tokens m x seq / CP.
Bytes move activations at `act` bytes (2 under bf16 autocast, 4 in float32) and the float32 stream at 4.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megamamba.config import MambaConfig

STREAM = 4  # the residual stream between layers is float32


@dataclass(frozen=True)
class RankShape:
    """What a rank holds of a micro-batch: the model, the whole sequence's length, the TP and CP sizes, the
    bytes of an activation element, and the expert-parallel size."""

    model: MambaConfig
    micro_batch_size: int
    seq_length: int
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    act: int = 2
    ep: int = 1

    @property
    def slice_length(self) -> int:
        """Positions of each sequence this rank works on: its context slice."""
        return self.seq_length // self.cp

    @property
    def tokens(self) -> int:
        """Tokens a mixer works on: the rank's context slice of every sequence of the micro-batch."""
        return self.micro_batch_size * self.slice_length

    @property
    def stream_tokens(self) -> int:
        """Tokens of the stream between layers: a TP shard of them under sequence parallelism."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens

    @property
    def stream_width(self) -> int:
        """Per-token width of the stream a rank holds: d_model, or its sequence share under SP."""
        return self.model.d_model // self.tp if self.sequence_parallel else self.model.d_model

    @property
    def local_vocab(self) -> int:
        """Rows of the padded vocabulary a rank holds."""
        return math.ceil(self.model.padded_vocab_size / self.tp)


@dataclass(frozen=True)
class Kernel:
    kind: str  # a profile kernel kind (`pipelines.planner.profile.KERNELS`)
    flops: float
    bytes: float
    checkpointed: bool = False  # recomputed in the backward (context parallelism's corrections)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send
    nbytes: float
    group: str  # tp, cp, ep
    backward: bool = False
    overlaps: Optional[Kernel] = None  # runs beside `share` x this kernel's forward time
    share: float = 0.0


@dataclass(frozen=True)
class LayerWork:
    kernels: tuple
    collectives: tuple = ()

    def __add__(self, other: "LayerWork") -> "LayerWork":
        return LayerWork(self.kernels + other.kernels, self.collectives + other.collectives)

    def kernel(self, kind: str) -> Kernel:
        """The first kernel of `kind` (a profile kernel kind)."""
        return next(k for k in self.kernels if k.kind == kind)


def activation_bytes(dtype: torch.dtype) -> int:
    """Bytes of an activation element computed in `dtype`: 2 for bf16, 4 for float32."""
    return 2 if dtype == torch.bfloat16 else 4


def pair(forward: str, backward: str, nbytes: float, group: str) -> tuple:
    """A collective forward and its adjoint backward ("" for none)."""
    return tuple(Collective(kind, nbytes, group, b) for kind, b in ((forward, False), (backward, True)) if kind)


def matmul(shape: RankShape, d_in: int, d_out: int) -> Kernel:
    t, a = shape.tokens, shape.act
    return Kernel("matmul", 2 * t * d_in * d_out, a * (d_in * d_out + t * (d_in + d_out)))


def norm(shape: RankShape) -> Kernel:
    return Kernel("norm", 0, shape.stream_tokens * shape.model.d_model * (STREAM + shape.act))


def replicated_gradients(shape: RankShape, *floats: int) -> tuple:
    """Backward all-reduces over TP of float32 gradients of parameters every rank holds whole but uses
    on its own part (`copy_to_tp_region`), one per parameter of `floats` elements (0: absent)."""
    return tuple(Collective("all_reduce", n * STREAM, "tp", True) for n in floats if n and shape.tp > 1)


def norm_weights(shape: RankShape) -> tuple:
    """A norm's weight (and LayerNorm's bias) under sequence parallelism: each rank sees other tokens."""
    d = shape.model.d_model
    return replicated_gradients(shape, d, 0 if shape.model.rms_norm else d) if shape.sequence_parallel else ()


def stream_in(shape: RankShape, projection: Kernel) -> tuple:
    """The column-parallel input `projection` (`megamamba.parallel.tensor.linear`): under sequence
    parallelism the all-gather of the normed shard, beside the product of this rank's own tokens; backward
    its input gradient's reduce-scatter (all-reduce without sequence parallelism), beside the weight
    gradient's product (as long as the forward's)."""
    if shape.tp == 1:
        return ()
    nbytes = shape.tokens * shape.model.d_model * shape.act
    backward = Collective(
        "reduce_scatter" if shape.sequence_parallel else "all_reduce", nbytes, "tp", True, projection, 1.0
    )
    if not shape.sequence_parallel:
        return (backward,)
    return Collective("all_gather", nbytes, "tp", False, projection, 1 / shape.tp), backward


def stream_out(shape: RankShape, copies: int = 1, bias: bool = False) -> tuple:
    """The row-parallel output projection's sum (`copies` slots of it) onto the stream: reduce-scatter
    forward and all-gather backward under sequence parallelism, else an all-reduce forward."""
    d = shape.model.d_model
    bias_gradient = replicated_gradients(shape, bias * d) if shape.sequence_parallel else ()
    return onto_stream(shape, copies * shape.tokens * d * shape.act) + bias_gradient


def tp_reductions(shape: RankShape, projection: Kernel, out_bias: bool = False) -> tuple:
    """A block's pre-norm, input `projection` and output projection across TP."""
    return norm_weights(shape) + stream_in(shape, projection) + stream_out(shape, bias=out_bias)


def onto_stream(shape: RankShape, nbytes: int) -> tuple:
    """A sum of partial results over TP onto the stream (`nbytes` of them): reduce-scatter forward and
    all-gather backward under sequence parallelism, else an all-reduce forward."""
    if shape.tp == 1:
        return ()
    if shape.sequence_parallel:
        return pair("reduce_scatter", "all_gather", nbytes, "tp")
    return pair("all_reduce", "", nbytes, "tp")
