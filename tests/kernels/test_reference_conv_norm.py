"""Reference causal_conv1d and rmsnorm_gated against the naive versions."""

import pytest
import torch

import naive_ops
from megamamba.kernels.reference.conv import causal_conv1d
from megamamba.kernels.reference.norm import rmsnorm_gated

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def conv_inputs(seed, width=4, batch=2, dim=5, seqlen=23):
    gen = torch.Generator().manual_seed(seed)
    return dict(x=randn(gen, batch, dim, seqlen), weight=randn(gen, dim, width), bias=randn(gen, dim))


def documents():
    """Row 0: a one-token document at 3, another from 4 (shorter than the kernel), the last at 16;
    row 1: ids 9 then 0 (a reused id still starts a new document)."""
    seq = torch.zeros(2, 23, dtype=torch.int32)
    seq[0, 3:], seq[0, 4:], seq[0, 16:] = 1, 2, 3
    seq[1, :], seq[1, 11:] = 9, 0
    return seq


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_conv_matches_naive(dtype, activation, with_documents):
    seed = 31
    tensors = conv_inputs(seed) | ({"seq_idx": documents()} if with_documents else {})
    naive_ops.assert_matches_naive(
        causal_conv1d, naive_ops.causal_conv1d, tensors, dtype, TOLERANCE[dtype], seed, activation=activation
    )


def test_conv_without_bias_and_width_two_matches_naive():
    tensors = conv_inputs(32, width=2)
    del tensors["bias"]
    naive_ops.assert_matches_naive(
        causal_conv1d,
        naive_ops.causal_conv1d,
        tensors | {"seq_idx": documents()},
        torch.float64,
        TOLERANCE[torch.float64],
        32,
    )


def test_conv_refuses_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be one of \(None, 'silu', 'swish'\), got 'relu'"):
        causal_conv1d(**conv_inputs(33), activation="relu")


def test_conv_refuses_weight_of_other_dim():
    t = conv_inputs(34)
    t["weight"] = t["weight"][:4]
    with pytest.raises(ValueError, match=r"weight must have shape \(dim, width\) with dim = 5"):
        causal_conv1d(**t)


def norm_inputs(seed, hidden=12):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=randn(gen, 3, 5, hidden), weight=randn(gen, hidden), bias=randn(gen, hidden), z=randn(gen, 3, 5, hidden)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_norm_matches_naive(dtype, group_size, norm_before_gate):
    seed = 41
    naive_ops.assert_matches_naive(
        rmsnorm_gated,
        naive_ops.rmsnorm_gated,
        norm_inputs(seed),
        dtype,
        TOLERANCE[dtype],
        seed,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        eps=1e-5,
    )


def test_norm_without_gate_or_bias_matches_naive():
    t = norm_inputs(42)
    del t["z"], t["bias"]
    naive_ops.assert_matches_naive(
        rmsnorm_gated, naive_ops.rmsnorm_gated, t, torch.float64, TOLERANCE[torch.float64], 42, group_size=6
    )


def test_norm_refuses_group_size_not_dividing_hidden():
    with pytest.raises(ValueError, match=r"group_size \(5\) must divide the last dim of x \(12\)"):
        rmsnorm_gated(**norm_inputs(43), group_size=5)


def test_ops_keep_bfloat16():
    c = {k: v.to(torch.bfloat16) for k, v in conv_inputs(44).items()}
    n = {k: v.to(torch.bfloat16) for k, v in norm_inputs(44).items()}
    assert causal_conv1d(**c, seq_idx=documents()).dtype == torch.bfloat16
    assert rmsnorm_gated(**n).dtype == torch.bfloat16
