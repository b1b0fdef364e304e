"""bf16 Triton causal_conv1d, rmsnorm_gated and add_rmsnorm (TRITON_INTERPRET=1 on the CPU)
against float64, beside what mamba_ssm runs on the same values with the same cotangents.

Inputs as the mixers and blocks pass them under bf16 autocast: activations in bf16; conv weight
and bias, norm weights and the residual stream (residual_in_fp32) in float32. mamba_ssm's
counterparts: for the conv, torch's depthwise conv1d + silu under autocast (weight and bias cast
to bf16; the causal-conv1d package is not installed), which has no seq_idx, so documents are held
to float64 with the bar it sets on the same inputs without them; layernorm_gated.rmsnorm_fn for
the gated norm; layer_norm.rms_norm_fn (prenorm, residual_in_fp32) for the fused add + norm.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import naive_ops
from bf16_checks import FLOOR, RATIO, assert_within_theirs, errors
from megamamba.kernels.triton import add_rmsnorm, causal_conv1d, rmsnorm_gated

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
BATCH, SEQLEN = 2, 77  # seqlen not a multiple of the conv's 64-step or 8-step blocks
CONV_DIM, WIDTH = 37, 4  # 37 channels: partly masked channel blocks (8 or 64 wide)
HIDDEN, GROUP = 72, 24  # norm groups of 24 channels: partly masked 32-wide blocks
EPS = 1e-5


def bf16(t):
    return t.to(torch.bfloat16)


def conv_inputs(seed, channel_last):
    """x (batch, dim, seqlen) in bf16, a transposed (batch, seqlen, dim) as Mamba-2 passes it when
    channel_last; weight, bias float32."""
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(BATCH, SEQLEN, CONV_DIM, generator=gen).transpose(1, 2)
        if channel_last
        else torch.randn(BATCH, CONV_DIM, SEQLEN, generator=gen)
    )
    return dict(
        x=bf16(x),
        weight=0.5 * torch.randn(CONV_DIM, WIDTH, generator=gen),
        bias=0.2 * torch.randn(CONV_DIM, generator=gen),
    )


def documents(seed):
    """seq_idx with several documents per row, one id reused after another document."""
    gen = torch.Generator().manual_seed(seed + 3)
    cuts = torch.sort(torch.randint(1, SEQLEN, (BATCH, 3), generator=gen), dim=1).values
    seq = (torch.arange(SEQLEN)[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
    return torch.where(seq == 2, torch.zeros_like(seq), seq)


def torch_conv(x, weight, bias, activation):
    """mamba_ssm's conv without causal-conv1d: nn.Conv1d under autocast (bf16 weight and bias), cut
    to the causal part, then silu."""
    out = F.conv1d(x, bf16(weight).unsqueeze(1), bf16(bias), padding=weight.shape[1] - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])


@functools.lru_cache(maxsize=None)
def conv_errors(conv, seed, channel_last):
    """Errors of `conv` (ours or torch's) without documents, kept for the tests that share them."""
    return errors(conv, naive_ops.causal_conv1d, conv_inputs(seed, channel_last), seed, activation="silu")


@pytest.mark.parametrize("channel_last", [False, True])
def test_bf16_causal_conv1d_within_mamba_ssm_error(channel_last):
    """Mamba-1's time-contiguous and Mamba-2's channel-last input: output, dx, dweight, dbias."""
    seed = 3000 + channel_last
    assert_within_theirs(
        conv_errors(causal_conv1d, seed, channel_last), conv_errors(torch_conv, seed, channel_last), seed
    )


@pytest.mark.parametrize("channel_last", [False, True])
def test_bf16_causal_conv1d_documents_within_no_document_bar(channel_last):
    """Packed documents (seq_idx): every quantity within RATIO x torch's error without documents."""
    seed = 3010 + channel_last
    t = dict(conv_inputs(seed, channel_last), seq_idx=documents(seed))
    ours = errors(causal_conv1d, naive_ops.causal_conv1d, t, seed, activation="silu")
    bar = conv_errors(torch_conv, seed, channel_last)
    for name, err in ours.items():
        limit = max(RATIO * bar[name], FLOOR)
        assert math.isfinite(limit) and err <= limit, (
            f"seed {seed}: {name} error {err:.2e} > {limit:.2e} (RATIO x torch's without documents)"
        )


def norm_inputs(seed, **extras):
    """x (batch, seqlen, hidden) in bf16, a float32 weight near 1, and each extra input in its dtype."""
    gen = torch.Generator().manual_seed(seed)
    t = dict(
        x=bf16(torch.randn(BATCH, SEQLEN, HIDDEN, generator=gen)), weight=1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    )
    t.update({name: torch.randn(BATCH, SEQLEN, HIDDEN, generator=gen).to(dtype) for name, dtype in extras.items()})
    return t


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_bf16_rmsnorm_gated_within_mamba_ssm_error(mamba_ssm, norm_before_gate):
    """Mamba-2's gated norm: x, z in bf16 (batch, seqlen, hidden), float32 weight, groups of 24."""
    seed = 3100 + norm_before_gate
    t = norm_inputs(seed, z=torch.bfloat16)
    options = dict(eps=EPS, group_size=GROUP, norm_before_gate=norm_before_gate)

    def theirs(x, weight, z, **kw):
        return mamba_ssm.rmsnorm_fn(x, weight, None, z=z, **kw)

    assert_within_theirs(
        errors(rmsnorm_gated, naive_ops.rmsnorm_gated, t, seed, **options),
        errors(theirs, naive_ops.rmsnorm_gated, t, seed, **options),
        seed,
    )


def add_norm_oracle(x, weight, residual=None):
    r = x if residual is None else x + residual
    return naive_ops.rmsnorm_gated(r, weight, eps=EPS), r


def add_norm_ours(x, weight, residual=None):
    """The block's pre-norm under autocast: the float32 normed output enters in_proj as bf16."""
    normed, r = add_rmsnorm(x, residual, weight, eps=EPS, residual_dtype=torch.float32)
    return bf16(normed), r


@pytest.mark.parametrize("with_residual", [True, False])
def test_bf16_add_rmsnorm_within_mamba_ssm_error(mamba_ssm, with_residual):
    """A block's bf16 mixer output plus the float32 residual (or a bf16 input alone, kept as a
    float32 residual), float32 weight: the normed output, the new residual and every gradient."""
    seed = 3200 + with_residual
    t = norm_inputs(seed, residual=torch.float32) if with_residual else norm_inputs(seed)

    def theirs(x, weight, residual=None):
        return mamba_ssm.rms_norm_fn(x, weight, None, residual=residual, prenorm=True, residual_in_fp32=True, eps=EPS)

    names = ("normed", "residual")
    assert_within_theirs(
        errors(add_norm_ours, add_norm_oracle, t, seed, names), errors(theirs, add_norm_oracle, t, seed, names), seed
    )
