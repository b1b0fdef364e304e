"""What one rank does for one micro-batch in each layer of the list: kernels (FLOPs, bytes) and collectives.

Forward only; the step-time model derives the backward from each kernel kind's backward ratio. Sizes are
a rank's: channels and heads divided by TP (key/value heads and B/C groups kept whole where they are
replicated), tokens m x seq / CP (the worst context-parallel rank for attention, whose causal work grows
along the sequence). Bytes move activations at `act` bytes (2 under bf16 autocast, 4 in float32) and the
float32 stream at 4. Collectives are counted as our layers issue them (docs/code.md, docs/context-parallel.md):
the `nbytes` of the full tensor, as `megamamba.parallel.comm_counter` counts.
"""
from dataclasses import dataclass

from megamamba.config import Mamba1Options, MambaConfig

STREAM = 4  # the residual stream between layers is float32


@dataclass(frozen=True)
class Kernel:
    kind: str  # a profile kernel kind: matmul, ssd, scan, conv, norm, attention, elementwise
    flops: float
    bytes: float


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, send
    nbytes: float
    group: str  # tp, cp
    backward: bool = False


@dataclass(frozen=True)
class LayerWork:
    kernels: tuple
    collectives: tuple = ()


@dataclass(frozen=True)
class RankShape:
    """What a rank holds of a micro-batch: the model, tokens per sequence slice, the TP and CP sizes."""
    model: MambaConfig
    micro_batch_size: int
    seq_length: int
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    act: int = 2

    @property
    def tokens(self) -> int:
        """Tokens a mixer works on: the rank's context slice of every sequence of the micro-batch."""
        return self.micro_batch_size * self.seq_length // self.cp

    @property
    def stream_tokens(self) -> int:
        """Tokens of the stream between layers: a TP shard of them under sequence parallelism."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


def _matmul(shape: RankShape, d_in: int, d_out: int) -> Kernel:
    t, a = shape.tokens, shape.act
    return Kernel("matmul", 2 * t * d_in * d_out, a * (d_in * d_out + t * (d_in + d_out)))


def _norm(shape: RankShape) -> Kernel:
    return Kernel("norm", 0, shape.stream_tokens * shape.model.d_model * (STREAM + shape.act))


def _tp_reductions(shape: RankShape) -> tuple:
    """A block's stream in and out across TP: one all-reduce forward and one backward, or with sequence
    parallelism an all-gather and a reduce-scatter each way (the same bytes on a ring)."""
    if shape.tp == 1:
        return ()
    nbytes = shape.tokens * shape.model.d_model * shape.act
    if not shape.sequence_parallel:
        return (Collective("all_reduce", nbytes, "tp"), Collective("all_reduce", nbytes, "tp", backward=True))
    return tuple(Collective(kind, nbytes, "tp", backward) for backward in (False, True)
                 for kind in ("all_gather", "reduce_scatter"))


def _state_passing(shape: RankShape, summary_floats: int) -> tuple:
    """Context parallelism's all-gather of every slice's state summary forward, reduce-scatter backward."""
    if shape.cp == 1:
        return ()
    nbytes = shape.cp * shape.micro_batch_size * summary_floats * 4
    return Collective("all_gather", nbytes, "cp"), Collective("reduce_scatter", nbytes, "cp", backward=True)


def mamba2_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = model.mixer_options
    d, di, h, n = model.d_model, model.d_inner // tp, model.nheads // tp, o.d_state
    groups = o.ngroups // tp if o.ngroups % tp == 0 else 1  # groups this rank's heads read
    bc = o.ngroups * n // tp if o.ngroups % tp == 0 else o.ngroups * n  # replicated B/C computed whole
    q = min(o.chunk_size, shape.seq_length // shape.cp)
    conv = di + 2 * bc
    kernels = (
        _norm(shape),
        _matmul(shape, d, 2 * di + 2 * bc + h),
        Kernel("conv", 2 * o.d_conv * t * conv, 2 * a * t * conv),
        Kernel("ssd", t * (2 * q * n * groups + 2 * q * di + 4 * n * di), a * t * (2 * di + 2 * groups * n + h)),
        Kernel("norm", 0, 3 * a * t * di),
        _matmul(shape, di, d),
    )
    return LayerWork(kernels, _tp_reductions(shape) + _state_passing(shape, h + h * o.headdim * n))


def mamba1_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = model.mixer_options
    d, di, n, r = model.d_model, model.d_inner // tp, o.d_state, model.dt_rank
    kernels = (
        _norm(shape),
        _matmul(shape, d, 2 * di),
        Kernel("conv", 2 * o.d_conv * t * di, 2 * a * t * di),
        _matmul(shape, di, r + 2 * n),
        _matmul(shape, r, di),
        Kernel("scan", 9 * t * di * n, a * t * (4 * di + 2 * n)),
        _matmul(shape, di, d),
    )
    collectives = _tp_reductions(shape)
    if tp > 1:  # x_proj's small output is summed over TP forward, its gradient backward
        nbytes = t * (r + 2 * n) * a
        collectives += (Collective("all_reduce", nbytes, "tp"), Collective("all_reduce", nbytes, "tp", backward=True))
    return LayerWork(kernels, collectives + _state_passing(shape, 2 * model.d_inner * n // tp))


def causal_pairs(shape: RankShape) -> int:
    """(query, key) pairs of one sequence on the busiest context-parallel rank (the last slice sees every key)."""
    width = shape.seq_length // shape.cp
    return width * width * (shape.cp - 1) + width * (width + 1) // 2


def attention_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = model.attention_options
    d, hd = model.d_model, model.head_dim_of(o)
    heads = o.num_heads // tp
    split = o.kv_heads % tp == 0
    kv = o.kv_heads // tp if split else 1  # the key/value heads this rank's queries read
    projected = kv if split else o.kv_heads  # replicated key/value heads are computed whole
    pairs = shape.micro_batch_size * causal_pairs(shape)
    kernels = [_norm(shape), _matmul(shape, d, (heads + 2 * projected) * hd)]
    if o.rotary_emb_dim:
        kernels.append(Kernel("elementwise", 0, 2 * a * t * (heads + kv) * o.rotary_emb_dim))
    keys = t * shape.cp  # the whole sequence's keys under context parallelism
    kernels += [Kernel("attention", 4 * hd * heads * pairs, a * hd * (2 * t * heads + 2 * keys * kv)),
                _matmul(shape, heads * hd, d)]
    collectives = _tp_reductions(shape)
    if shape.cp > 1:
        nbytes = keys * 2 * kv * hd * a
        collectives += (Collective("all_gather", nbytes, "cp"), Collective("reduce_scatter", nbytes, "cp", True))
    return LayerWork(tuple(kernels), collectives)


def mlp_kernels(shape: RankShape) -> tuple:
    model, t, a = shape.model, shape.tokens, shape.act
    width = model.mlp_width // shape.tp
    gated = model.mlp_activation == "gated_silu"
    return (_norm(shape), _matmul(shape, model.d_model, (2 if gated else 1) * width),
            Kernel("elementwise", 0, (3 if gated else 2) * a * t * width), _matmul(shape, width, model.d_model))


def block_work(shape: RankShape, kind: str) -> LayerWork:
    """A block of `kind` ("mamba", "attention", "mlp"), with mamba_ssm's inner MLP when the config has one."""
    if kind == "mlp":
        return LayerWork(mlp_kernels(shape), _tp_reductions(shape))
    if kind == "attention":
        work = attention_work(shape)
    elif isinstance(shape.model.mixer_options, Mamba1Options):
        work = mamba1_work(shape)
    else:
        work = mamba2_work(shape)
    if not shape.model.mlp_inside_blocks:
        return work
    return LayerWork(work.kernels + mlp_kernels(shape), work.collectives + _tp_reductions(shape))


def _vocab_rows(shape: RankShape) -> int:
    return -(-shape.model.padded_vocab_size // shape.tp)


def layer_work(shape: RankShape, kind: str) -> LayerWork:
    """The work of a layer of the list by its kind (`megamamba.model.layers.layer_kinds`)."""
    model, t, a = shape.model, shape.tokens, shape.act
    d = model.d_model
    if kind == "embedding":
        collectives = ()
        if shape.tp > 1:  # each rank looks up its rows; the float32 partial sums are reduced
            reduce = "reduce_scatter" if shape.sequence_parallel else "all_reduce"
            collectives = (Collective(reduce, t * d * STREAM, "tp"),)
        return LayerWork((Kernel("elementwise", 0, t * d * 2 * STREAM),), collectives)
    if kind == "final_norm":
        return LayerWork((_norm(shape),))
    if kind == "head":
        vocab = _vocab_rows(shape)
        collectives = ()
        if shape.tp > 1 and shape.sequence_parallel:
            collectives = (Collective("all_gather", t * d * a, "tp"),
                           Collective("reduce_scatter", t * d * a, "tp", backward=True))
        loss = Kernel("elementwise", 0, 2 * STREAM * t * vocab)  # float32 softmax and its gradient
        return LayerWork((_matmul(shape, d, vocab), loss), collectives)
    return block_work(shape, kind)


def boundary_bytes(shape: RankShape) -> int:
    """What a pipeline stage sends the next per micro-batch (and receives back as its gradient)."""
    return shape.stream_tokens * shape.model.d_model * STREAM

