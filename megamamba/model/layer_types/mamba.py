"""A Mamba block: the pre-norm residual block around a Mamba-1 or Mamba-2 mixer (pattern symbol M), and what
the framework knows of it (`MambaType`)."""

import math
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from megamamba import kernels
from megamamba.config import MAMBA_LETTER, Mamba1Options, Mamba2Options, Mamba3Options, MambaConfig
from megamamba.kernels.flops import conv_flops, selective_scan_flops, ssd_flops
from megamamba.model.block import Block
from megamamba.model.layer_types.base import BlockType
from megamamba.model.layer_types.costs import (
    STREAM,
    Kernel,
    LayerWork,
    RankShape,
    activation_bytes,
    matmul,
    norm,
    norm_weights,
    onto_stream,
    pair,
    replicated_gradients,
    stream_in,
    stream_out,
    tp_reductions,
)
from megamamba.model.layer_types.mlp import MLP_TYPE
from megamamba.model.mamba1 import Mamba1
from megamamba.model.mamba2 import Mamba2
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.model_layout import check_mixer_layout


def conv_options(config: MambaConfig) -> Union[Mamba1Options, Mamba2Options]:
    """The options of the Mamba-1 or Mamba-2 mixer config.ssm_cfg["layer"] names (Mamba-3 blocks are
    `layer_types/mamba3.py`'s)."""
    options = config.mixer_options
    if isinstance(options, Mamba3Options):
        raise ValueError(f"ssm_cfg.layer={config.layer!r}: a Mamba3 block is described by layer_types/mamba3.py")
    return options


def make_mamba_mixer(
    config: MambaConfig,
    device=None,
    dtype=None,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
) -> nn.Module:
    """The Mamba mixer that config.ssm_cfg["layer"] names, built with its options (split across `tp`; on a
    slice of the sequence in the context-parallel group `cp`)."""
    options = conv_options(config)
    if isinstance(options, Mamba1Options):
        return Mamba1(config.d_model, options, device=device, dtype=dtype, tp=tp, cp=cp)
    return Mamba2(config.d_model, options, device=device, dtype=dtype, tp=tp, cp=cp)


class MambaBlock(Block):
    """A block whose mixer is Mamba-1 or Mamba-2 (ssm_cfg.layer); pattern symbol M."""

    def __init__(
        self,
        config: MambaConfig,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            config, lambda: make_mamba_mixer(config, device=device, dtype=dtype, tp=tp, cp=cp), tp, device, dtype
        )


SCAN_CHECKPOINT_STEPS = 16  # Mamba-1's Triton scan keeps a float32 state every this many steps


def mamba1_layer_flops(config: MambaConfig) -> int:
    """Forward FLOPs per token of one Mamba-1 mixer."""
    o = conv_options(config)
    d, di, n, r = config.d_model, config.d_inner, o.d_state, config.dt_rank
    projections = 2 * d * 2 * di + 2 * di * (r + 2 * n) + 2 * r * di + 2 * di * d
    return projections + conv_flops(1, di, o.d_conv) + selective_scan_flops(1, di, n)


def _mamba2_options(config: MambaConfig) -> Mamba2Options:
    options = conv_options(config)
    if not isinstance(options, Mamba2Options):
        raise ValueError(f"ssm_cfg.layer={config.layer!r}: Mamba-2's costs need a Mamba2 mixer")
    return options


def mamba2_layer_flops(config: MambaConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one Mamba-2 mixer at sequence length `seq_length`."""
    o = _mamba2_options(config)
    d, di, n, g, h = config.d_model, config.d_inner, o.d_state, o.ngroups, config.nheads
    d_in_proj = 2 * di + 2 * g * n + h
    conv_dim = di + 2 * g * n
    projections = 2 * d * d_in_proj + 2 * di * d
    ssd = ssd_flops(1, seq_length, h, di // h, g, n, o.chunk_size)
    return projections + conv_flops(1, conv_dim, o.d_conv) + ssd


def _mamba2_widths(shape: RankShape) -> tuple:
    """A Mamba-2 mixer's local (d_inner, nheads, ngroups x d_state, B/C replicated over TP)."""
    model, tp = shape.model, shape.tp
    opts = _mamba2_options(model)
    groups = opts.ngroups * opts.d_state
    replicated = tp > 1 and opts.ngroups % tp != 0
    return model.d_inner // tp, model.nheads // tp, groups if replicated else groups // tp, replicated


def _mamba1_kept_bytes(shape: RankShape) -> int:
    """The normed input, in_proj's output (x, z), the conv's, x_proj's, delta, the scan's output; the float32
    state entering each of a sequence's chunks of the Triton scan (a whole chunk's for a sequence that ends
    inside one); A = -exp(A_log) twice (float32)."""
    model, a = shape.model, shape.act
    opts = conv_options(model)
    d_inner = model.d_inner // shape.tp
    x_proj_out = model.dt_rank + 2 * opts.d_state
    per_token = a * (model.d_model + 2 * d_inner + d_inner + x_proj_out + d_inner + d_inner)
    chunks = math.ceil(shape.slice_length / SCAN_CHECKPOINT_STEPS)
    states = STREAM * shape.micro_batch_size * chunks * d_inner * opts.d_state
    return per_token * shape.tokens + states + 2 * 4 * model.d_inner * opts.d_state // shape.tp


def _mamba2_kept_bytes(shape: RankShape) -> int:
    """The normed input, in_proj's output, the conv's, the scan's output, the gated norm's; A = -exp(A_log)
    twice (float32). With B/C replicated over TP: the norm across the ranks' summed out_proj products and
    1/rms, and the concatenated conv weight and bias, and in float32 in_proj's weight."""
    model, a = shape.model, shape.act
    opts = _mamba2_options(model)
    d_inner, nheads, bc, replicated = _mamba2_widths(shape)
    in_proj_out = 2 * d_inner + 2 * bc + nheads
    conv_out = d_inner + 2 * bc
    norm_out = d_inner if opts.rmsnorm else 0
    per_token = a * (model.d_model + in_proj_out + conv_out + d_inner + norm_out)
    if replicated and opts.rmsnorm:  # the norm spans ranks (parallel.tensor.spanning_norm): per group the summed
        # out_proj products and 1/rms (float32, and its bf16 copy under autocast), of this rank's sequence
        # shard under sequence parallelism
        per_group = a * model.d_model + 4 + (2 if a == 2 else 0)
        per_token += opts.ngroups * per_group // (shape.tp if shape.sequence_parallel else 1)
    constant = 2 * 4 * nheads
    if replicated:
        constant += 4 * conv_out * (opts.d_conv + (1 if opts.conv_bias else 0))
        if a == 4:
            constant += 4 * in_proj_out * (model.d_model + (1 if opts.bias else 0))
    return per_token * shape.tokens + constant


def _state_passing(shape: RankShape, summary_floats: int, conv_channels: int) -> tuple:
    """Context parallelism: the conv halo to the next rank (its gradient back), and the all-gather of every
    slice's state summary forward, reduce-scatter backward."""
    if shape.cp == 1:
        return ()
    halo = shape.micro_batch_size * conv_channels * (conv_options(shape.model).d_conv - 1) * shape.act
    nbytes = shape.cp * shape.micro_batch_size * summary_floats * STREAM
    return pair("send", "send", halo, "cp") + pair("all_gather", "reduce_scatter", nbytes, "cp")


def _mamba2_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = _mamba2_options(model)
    d, di, h, n = model.d_model, model.d_inner // tp, model.nheads // tp, o.d_state
    split = o.ngroups % tp == 0
    groups = o.ngroups // tp if split else 1  # groups this rank's heads read
    bc = o.ngroups * n // tp if split else o.ngroups * n  # replicated B/C computed whole
    q = min(o.chunk_size, shape.slice_length)
    conv = di + 2 * bc
    in_proj = matmul(shape, d, 2 * di + 2 * bc + h)
    kernels: tuple = (
        norm(shape),
        in_proj,
        Kernel("conv", 2 * o.d_conv * t * conv, 2 * a * t * conv),
        Kernel("ssd", t * (2 * q * n * groups + 2 * q * di + 4 * n * di), a * t * (2 * di + 2 * groups * n + h)),
        Kernel("norm", 0, 3 * a * t * di),
        matmul(shape, di, d),
    )
    if shape.cp > 1:  # the entering state's contribution C_t h0 exp(cumsum dt A): a float32 einsum
        kernels += (Kernel("matmul_fp32", 2 * t * di * n, STREAM * t * (2 * di + groups * n), checkpointed=True),)
    collectives = norm_weights(shape) + stream_in(shape, in_proj)
    spanning = tp > 1 and not split and o.rmsnorm  # the gated norm's groups span ranks: ngroups slots summed
    collectives += stream_out(shape, o.ngroups if spanning else 1, o.bias)
    if spanning:  # beside the products, each group's mean square in float32
        collectives += onto_stream(shape, t * o.ngroups * STREAM)
    if not split:  # B/C's in_proj rows and conv channels, replicated
        rows = 2 * o.ngroups * n
        collectives += replicated_gradients(shape, rows * d, rows * o.bias, rows * o.d_conv, rows * o.conv_bias)
    return LayerWork(kernels, collectives + _state_passing(shape, h + h * o.headdim * n, conv))


def _mamba1_work(shape: RankShape) -> LayerWork:
    model, tp, t, a = shape.model, shape.tp, shape.tokens, shape.act
    o = conv_options(model)
    d, di, n, r = model.d_model, model.d_inner // tp, o.d_state, model.dt_rank
    scan = Kernel("scan", 9 * t * di * n, a * t * (4 * di + 2 * n))
    in_proj = matmul(shape, d, 2 * di)
    kernels: tuple = (
        norm(shape),
        in_proj,
        Kernel("conv", 2 * o.d_conv * t * di, 2 * a * t * di),
        matmul(shape, di, r + 2 * n),
        matmul(shape, r, di),
        scan,
        matmul(shape, di, d),
    )
    if shape.cp > 1:  # the entering state's contribution: a second scan, of a zero input from h0
        kernels += (Kernel("scan", scan.flops, scan.bytes, checkpointed=True),)
    collectives = tp_reductions(shape, in_proj, o.bias)
    if tp > 1:  # x_proj's small output is summed over TP forward, its gradient backward
        collectives += pair("all_reduce", "all_reduce", t * (r + 2 * n) * a, "tp")
    return LayerWork(kernels, collectives + _state_passing(shape, 2 * model.d_inner * n // tp, di))


def _mamba1_weight_elements(shape: RankShape) -> int:
    model, d = shape.model, shape.model.d_model
    d_inner, r, n = model.d_inner // shape.tp, model.dt_rank, conv_options(model).d_state
    return d * 2 * d_inner + d_inner * (r + 2 * n) + r * d_inner + d_inner * d


def _mamba2_weight_elements(shape: RankShape) -> int:
    d_inner, nheads, bc, _ = _mamba2_widths(shape)
    return shape.model.d_model * (2 * d_inner + 2 * bc + nheads) + d_inner * shape.model.d_model


class MixerCosts(NamedTuple):
    """One Mamba mixer's costs: forward FLOPs per token (config, seq_length), and for a rank's shape the bytes
    kept for the backward, the Linear weights multiplied, the kernels and collectives."""

    flops: Callable[[MambaConfig, int], int]
    kept_bytes: Callable[[RankShape], int]
    weight_elements: Callable[[RankShape], int]
    work: Callable[[RankShape], LayerWork]


MAMBA1_COSTS = MixerCosts(
    lambda config, seq_length: mamba1_layer_flops(config), _mamba1_kept_bytes, _mamba1_weight_elements, _mamba1_work
)
MAMBA2_COSTS = MixerCosts(mamba2_layer_flops, _mamba2_kept_bytes, _mamba2_weight_elements, _mamba2_work)


def _costs(config: MambaConfig) -> MixerCosts:
    """The costs of the mixer config.ssm_cfg["layer"] names."""
    return MAMBA1_COSTS if isinstance(conv_options(config), Mamba1Options) else MAMBA2_COSTS


class MambaType(BlockType):
    """The Mamba block (Mamba-1 or Mamba-2, as ssm_cfg.layer says), on the Triton kernels' activations
    (each scan, conv and norm keeps its inputs and recomputes the rest)."""

    kind, symbol, block_class = "mamba", MAMBA_LETTER, MambaBlock
    inner_mlp = MLP_TYPE

    def label(self, config: MambaConfig) -> str:
        return config.layer

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        check_mixer_layout(config.d_model, conv_options(config), tp_size)

    def conv_width(self, config: MambaConfig) -> int:
        return conv_options(config).d_conv

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return _costs(config).flops(config, seq_length)

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        return _costs(shape.model).kept_bytes(shape)

    def mixer_weight_elements(self, shape: RankShape) -> int:
        return _costs(shape.model).weight_elements(shape)

    def mixer_work(self, shape: RankShape) -> LayerWork:
        return _costs(shape.model).work(shape)

    def kernel_benchmarks(self, config: MambaConfig, batch: int, seq_length: int, device, dtype) -> dict:
        """Mamba-2: the conv, the SSD scan, and the float32 product context parallelism adds; Mamba-1: the scan."""

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.5

        o, t = conv_options(config), batch * seq_length
        work = self.mixer_work(RankShape(config, batch, seq_length, act=activation_bytes(dtype)))
        if isinstance(o, Mamba1Options):
            di, n = config.d_inner, o.d_state
            scan = (
                lambda u, delta, a, bb, c: kernels.selective_scan(u, delta, -torch.exp(a), bb, c, delta_softplus=True),
                [rand(batch, di, seq_length), rand(batch, di, seq_length), rand(di, n), rand(batch, 1, n, seq_length)]
                + [rand(batch, 1, n, seq_length)],
                work.kernel("scan"),
            )
            return {"scan": scan}
        h, p, g, n = config.nheads, o.headdim, o.ngroups, o.d_state
        conv, di = config.d_inner + 2 * g * n, config.d_inner
        product = Kernel("matmul_fp32", 2 * t * n * di, 4 * (t * n + n * di + t * di))
        return {
            "matmul_fp32": (
                torch.matmul,
                [torch.randn(t, n, device=device), torch.randn(n, di, device=device)],
                product,
            ),
            "conv": (
                lambda x, w, b: kernels.causal_conv1d(x, w, b, activation="silu"),
                [rand(batch, conv, seq_length), rand(conv, o.d_conv), rand(conv)],
                work.kernel("conv"),
            ),
            "ssd": (
                lambda x, dt, a, bb, c: kernels.ssd_chunk_scan(
                    x, dt, -torch.exp(a), bb, c, o.chunk_size, dt_softplus=True
                ),
                [rand(batch, seq_length, h, p), rand(batch, seq_length, h), rand(h)]
                + [rand(batch, seq_length, g, n), rand(batch, seq_length, g, n)],
                work.kernel("ssd"),
            ),
        }


MAMBA_TYPE = MambaType()
