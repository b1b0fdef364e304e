"""What one rank does for one micro-batch in each layer of the list: kernels (FLOPs, bytes) and collectives.

Forward only; the step-time model derives the backward from each kernel kind's backward ratio (a kernel
run under `torch.utils.checkpoint` inside the layer runs its forward again in the backward). Sizes are
a rank's: channels and heads divided by TP (key/value heads and B/C groups kept whole where they are
replicated), tokens m x seq / CP (the worst context-parallel rank for attention, whose causal work grows
along the sequence). Bytes move activations at `act` bytes (2 under bf16 autocast, 4 in float32) and the
float32 stream at 4. Collectives are those our layers issue (docs/code.md, docs/context-parallel.md), with
the `nbytes` `megamamba.parallel.comm_counter` counts; tests/pipelines/planner/test_planner_collectives.py checks them
against the counter. The worst rank's: a context-parallel halo is both sent and received.
"""

from dataclasses import dataclass
from typing import Optional

from megamamba.config import Mamba1Options, MambaConfig

STREAM = 4  # the residual stream between layers is float32


@dataclass(frozen=True)
class Kernel:
    kind: str  # a profile kernel kind (`pipelines.planner.profile.KERNELS`)
    flops: float
    bytes: float
    checkpointed: bool = False  # recomputed in the backward (context parallelism's corrections)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, send
    nbytes: float
    group: str  # tp, cp
    backward: bool = False
    overlaps: Optional[Kernel] = None  # runs beside `share` x this kernel's forward time
    share: float = 0.0


def _pair(forward: str, backward: str, nbytes: float, group: str) -> tuple:
    """A collective forward and its adjoint backward ("" for none)."""
    return tuple(Collective(kind, nbytes, group, b) for kind, b in ((forward, False), (backward, True)) if kind)


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


def _replicated_gradients(shape: RankShape, *floats: int) -> tuple:
    """Backward all-reduces over TP of float32 gradients of parameters every rank holds whole but uses
    on its own part (`copy_to_tp_region`), one per parameter of `floats` elements (0: absent)."""
    return tuple(Collective("all_reduce", n * STREAM, "tp", True) for n in floats if n and shape.tp > 1)


def _norm_weights(shape: RankShape) -> tuple:
    """A norm's weight (and LayerNorm's bias) under sequence parallelism: each rank sees other tokens."""
    d = shape.model.d_model
    return _replicated_gradients(shape, d, 0 if shape.model.rms_norm else d) if shape.sequence_parallel else ()


def _stream_in(shape: RankShape, projection: Kernel) -> tuple:
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


def _stream_out(shape: RankShape, copies: int = 1, bias: bool = False) -> tuple:
    """The row-parallel output projection's sum (`copies` slots of it) onto the stream: reduce-scatter
    forward and all-gather backward under sequence parallelism, else an all-reduce forward."""
    if shape.tp == 1:
        return ()
    nbytes = copies * shape.tokens * shape.model.d_model * shape.act
    if not shape.sequence_parallel:
        return _pair("all_reduce", "", nbytes, "tp")
    gathered = _pair("reduce_scatter", "all_gather", nbytes, "tp")
    return gathered + _replicated_gradients(shape, bias * shape.model.d_model)


def _tp_reductions(shape: RankShape, projection: Kernel, out_bias: bool = False) -> tuple:
    """A block's pre-norm, input `projection` and output projection across TP."""
    return _norm_weights(shape) + _stream_in(shape, projection) + _stream_out(shape, bias=out_bias)


def _state_passing(shape: RankShape, summary_floats: int, conv_channels: int) -> tuple:
    """Context parallelism: the conv halo to the next rank (its gradient back), and the all-gather of every
    slice's state summary forward, reduce-scatter backward."""
    if shape.cp == 1:
        return ()
    halo = shape.micro_batch_size * conv_channels * (shape.model.mixer_options.d_conv - 1) * shape.act
    nbytes = shape.cp * shape.micro_batch_size * summary_floats * STREAM
    return _pair("send", "send", halo, "cp") + _pair("all_gather", "reduce_scatter", nbytes, "cp")


def mamba2_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = model.mixer_options
    d, di, h, n = model.d_model, model.d_inner // tp, model.nheads // tp, o.d_state
    split = o.ngroups % tp == 0
    groups = o.ngroups // tp if split else 1  # groups this rank's heads read
    bc = o.ngroups * n // tp if split else o.ngroups * n  # replicated B/C computed whole
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
    if shape.cp > 1:  # the entering state's contribution C_t h0 exp(cumsum dt A): a float32 einsum
        kernels += (Kernel("matmul_fp32", 2 * t * di * n, STREAM * t * (2 * di + groups * n), checkpointed=True),)
    collectives = _norm_weights(shape) + _stream_in(shape, kernels[1])
    spanning = tp > 1 and not split and o.rmsnorm  # the gated norm's groups span ranks: ngroups slots summed
    collectives += _stream_out(shape, o.ngroups if spanning else 1, o.bias)
    if spanning:  # beside the products, each group's mean square in float32
        mean_square = t * o.ngroups * STREAM
        collectives += (
            _pair("reduce_scatter", "all_gather", mean_square, "tp")
            if shape.sequence_parallel
            else _pair("all_reduce", "", mean_square, "tp")
        )
    if not split:  # B/C's in_proj rows and conv channels, replicated
        rows = 2 * o.ngroups * n
        collectives += _replicated_gradients(shape, rows * d, rows * o.bias, rows * o.d_conv, rows * o.conv_bias)
    return LayerWork(kernels, collectives + _state_passing(shape, h + h * o.headdim * n, conv))


def mamba1_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = model.mixer_options
    d, di, n, r = model.d_model, model.d_inner // tp, o.d_state, model.dt_rank
    scan = Kernel("scan", 9 * t * di * n, a * t * (4 * di + 2 * n))
    kernels = (
        _norm(shape),
        _matmul(shape, d, 2 * di),
        Kernel("conv", 2 * o.d_conv * t * di, 2 * a * t * di),
        _matmul(shape, di, r + 2 * n),
        _matmul(shape, r, di),
        scan,
        _matmul(shape, di, d),
    )
    if shape.cp > 1:  # the entering state's contribution: a second scan, of a zero input from h0
        kernels += (Kernel("scan", scan.flops, scan.bytes, checkpointed=True),)
    collectives = _tp_reductions(shape, kernels[1], o.bias)
    if tp > 1:  # x_proj's small output is summed over TP forward, its gradient backward
        collectives += _pair("all_reduce", "all_reduce", t * (r + 2 * n) * a, "tp")
    return LayerWork(kernels, collectives + _state_passing(shape, 2 * model.d_inner * n // tp, di))


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
    kernels += [
        Kernel("attention", 4 * hd * heads * pairs, a * hd * (2 * t * heads + 2 * keys * kv)),
        _matmul(shape, heads * hd, d),
    ]
    collectives = _tp_reductions(shape, kernels[1], o.out_proj_bias)
    if not split:  # the key/value rows of in_proj, replicated
        rows = 2 * o.kv_heads * hd
        collectives += _replicated_gradients(shape, rows * d, rows * o.qkv_proj_bias)
    if shape.cp > 1:
        collectives += _pair("all_gather", "reduce_scatter", keys * 2 * kv * hd * a, "cp")
    return LayerWork(tuple(kernels), collectives)


def mlp_kernels(shape: RankShape) -> tuple:
    model, t, a = shape.model, shape.tokens, shape.act
    width = model.mlp_width // shape.tp
    gated = model.mlp_activation == "gated_silu"
    return (
        _norm(shape),
        _matmul(shape, model.d_model, (2 if gated else 1) * width),
        Kernel("elementwise", 0, (3 if gated else 2) * a * t * width),
        _matmul(shape, width, model.d_model),
    )


def block_work(shape: RankShape, kind: str) -> LayerWork:
    """A block of `kind` ("mamba", "attention", "mlp"), with mamba_ssm's inner MLP when the config has one."""
    mlp = mlp_kernels(shape)
    if kind == "mlp":
        return LayerWork(mlp, _tp_reductions(shape, mlp[1]))
    if kind == "attention":
        work = attention_work(shape)
    elif isinstance(shape.model.mixer_options, Mamba1Options):
        work = mamba1_work(shape)
    else:
        work = mamba2_work(shape)
    if not shape.model.mlp_inside_blocks:
        return work
    return LayerWork(work.kernels + mlp, work.collectives + _tp_reductions(shape, mlp[1]))


def _vocab_rows(shape: RankShape) -> int:
    return -(-shape.model.padded_vocab_size // shape.tp)


def _loss_collectives(shape: RankShape) -> tuple:
    """The vocab-parallel cross-entropy's float32 row maxima and (sum of exponentials, target logit); under
    context parallelism the counted tokens and the slices' sums of losses."""
    t = shape.tokens
    out = (
        _pair("all_reduce", "", t * STREAM, "tp") + _pair("all_reduce", "", 2 * t * STREAM, "tp")
        if shape.tp > 1
        else ()
    )
    return out + (_pair("all_reduce", "", STREAM, "cp") * 2 if shape.cp > 1 else ())


def layer_work(shape: RankShape, kind: str) -> LayerWork:
    """The work of a layer of the list by its kind (`megamamba.model.layers.layer_kinds`)."""
    t, d = shape.tokens, shape.model.d_model
    if kind == "embedding":
        collectives = ()
        if shape.tp > 1:  # each rank looks up its rows; the float32 partial sums are reduced
            collectives = (
                _pair("reduce_scatter", "all_gather", t * d * STREAM, "tp")
                if shape.sequence_parallel
                else _pair("all_reduce", "", t * d * STREAM, "tp")
            )
        return LayerWork((Kernel("elementwise", 0, t * d * 2 * STREAM),), collectives)
    if kind == "final_norm":
        return LayerWork((_norm(shape),), _norm_weights(shape))
    if kind == "head":
        head = _matmul(shape, d, _vocab_rows(shape))
        return LayerWork((head,), _stream_in(shape, head))
    return block_work(shape, kind)


def loss_work(shape: RankShape) -> LayerWork:
    """The loss after the head, outside the layer list (never recomputed): float32 softmax and gradient."""
    return LayerWork(
        (Kernel("elementwise", 0, 2 * STREAM * shape.tokens * _vocab_rows(shape)),), _loss_collectives(shape)
    )


def boundary_bytes(shape: RankShape) -> int:
    """What a pipeline stage sends the next per micro-batch (and receives back as its gradient)."""
    return shape.stream_tokens * shape.model.d_model * STREAM
