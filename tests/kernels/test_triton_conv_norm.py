"""Triton causal_conv1d and rmsnorm_gated (under TRITON_INTERPRET=1 on the CPU) against the
float64 per-timestep oracle: forward and every gradient within 1e-4 relative in float32."""

import pytest
import torch

import naive_ops
from megamamba.kernels.triton import causal_conv1d, rmsnorm_gated
from megamamba.testing.numerics import relative_error
from oracle_checks import TOL, check_against_oracle

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]


def documents(batch, seqlen, gen):
    """seq_idx with several documents per row, one id reused after another document."""
    cuts = torch.sort(torch.randint(1, seqlen, (batch, 3), generator=gen), dim=1).values
    pos = torch.arange(seqlen)
    seq = (pos[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
    return torch.where(seq == 2, torch.zeros_like(seq), seq)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_causal_conv1d_matches_oracle(width, activation, with_seq_idx):
    seed = 100 * width + 10 * (activation is not None) + with_seq_idx
    gen = torch.Generator().manual_seed(seed)
    batch, dim, seqlen = 2, 19, 77  # dim, seqlen not multiples of the blocks (16, 64)
    tensors = dict(
        x=torch.randn(batch, dim, seqlen, generator=gen),
        weight=torch.randn(dim, width, generator=gen),
        bias=torch.randn(dim, generator=gen),
    )
    if with_seq_idx:
        tensors["seq_idx"] = documents(batch, seqlen, gen)
    check_against_oracle(causal_conv1d, naive_ops.causal_conv1d, tensors, seed, activation=activation)


def test_causal_conv1d_without_bias_matches_oracle():
    seed = 7
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(x=torch.randn(1, 5, 70, generator=gen), weight=torch.randn(5, 4, generator=gen))
    check_against_oracle(causal_conv1d, naive_ops.causal_conv1d, tensors, seed, activation="swish")


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_causal_conv1d_channel_last_matches_oracle(width, with_seq_idx):
    """x a transposed (batch, seqlen, dim) slice, as Mamba-2 passes it, and a gradient in yet
    another layout: read through strides, the output and dx keep x's layout; 300 steps make each
    backward program walk several time blocks, the last partly past the end."""
    seed = 400 + 10 * width + with_seq_idx
    gen = torch.Generator().manual_seed(seed)
    batch, dim, seqlen = 2, 21, 300
    packed = torch.randn(batch, seqlen, dim + 9, generator=gen, dtype=torch.float64)
    weight = torch.randn(dim, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(dim, batch, seqlen, generator=gen, dtype=torch.float64).permute(1, 0, 2)
    seq_idx = documents(batch, seqlen, gen) if with_seq_idx else None
    results = []
    for dtype, fn in ((torch.float32, causal_conv1d), (torch.float64, naive_ops.causal_conv1d)):
        p, w, b = (t.to(dtype).requires_grad_() for t in (packed, weight, bias))
        out = fn(p[..., 4 : 4 + dim].transpose(1, 2), w, b, seq_idx=seq_idx, activation="silu")
        out.backward(grad.to(dtype))
        results.append((out, p.grad, w.grad, b.grad))
    assert results[0][0].stride(1) == 1, "the output is not channel-last like x"
    for name, got, ref in zip(("out", "grad of x", "grad of weight", "grad of bias"), *results):
        assert torch.isfinite(got).all(), f"seed {seed}: non-finite {name}"
        assert relative_error(got, ref) <= TOL, f"seed {seed}: {name} rel err {relative_error(got, ref):.2e}"


def test_causal_conv1d_64_bit_offsets_match_oracle(monkeypatch):
    """The INT64 specialization (sequences past 2^31 elements of offset) computes the same."""
    from megamamba.kernels.triton import conv

    monkeypatch.setattr(conv, "_needs_int64", lambda *tensors: True)
    seed = 500
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        x=torch.randn(2, 19, 77, generator=gen),
        weight=torch.randn(19, 3, generator=gen),
        bias=torch.randn(19, generator=gen),
        seq_idx=documents(2, 77, gen),
    )
    check_against_oracle(causal_conv1d, naive_ops.causal_conv1d, tensors, seed, activation="silu")


@pytest.mark.parametrize("gate", ["none", "before_norm", "after_norm"])
@pytest.mark.parametrize("group_size", [None, 12])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rmsnorm_gated_matches_oracle(gate, group_size, with_bias):
    seed = 1000 + 10 * ["none", "before_norm", "after_norm"].index(gate) + 2 * (group_size is None) + with_bias
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 7, 36)  # 21 rows: not a multiple of the 16-row block; 12-wide groups pad to 16
    tensors = dict(x=torch.randn(shape, generator=gen), weight=1 + 0.1 * torch.randn(36, generator=gen))
    if with_bias:
        tensors["bias"] = torch.randn(36, generator=gen)
    if gate != "none":
        tensors["z"] = torch.randn(shape, generator=gen)
    check_against_oracle(
        rmsnorm_gated,
        naive_ops.rmsnorm_gated,
        tensors,
        seed,
        group_size=group_size,
        norm_before_gate=gate != "after_norm",
        eps=1e-5,
    )


def test_rmsnorm_gated_wide_rows_use_few_rows_per_program():
    """4096-wide rows: one row per block (BLOCK_M = 1), rows not a multiple of anything."""
    seed = 1100
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        x=torch.randn(3, 4096, generator=gen),
        weight=torch.randn(4096, generator=gen),
        z=torch.randn(3, 4096, generator=gen),
    )
    check_against_oracle(rmsnorm_gated, naive_ops.rmsnorm_gated, tensors, seed, norm_before_gate=False)


@pytest.mark.parametrize("group_size", [12, 36])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rmsnorm_gated_backward_programs_walk_several_row_blocks(group_size, norm_before_gate):
    """301 rows: each backward program sums the weight gradient over several row blocks, the
    last of them partly or wholly past the end."""
    seed = 1200 + group_size + norm_before_gate
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        x=torch.randn(7, 43, 36, generator=gen),
        weight=1 + 0.1 * torch.randn(36, generator=gen),
        bias=torch.randn(36, generator=gen),
        z=torch.randn(7, 43, 36, generator=gen),
    )
    check_against_oracle(
        rmsnorm_gated,
        naive_ops.rmsnorm_gated,
        tensors,
        seed,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        eps=1e-5,
    )


def test_rmsnorm_gated_reads_column_slices_and_strided_gradients():
    """x and z as column slices of one wider tensor (as Mamba-2's z is of in_proj's output), and an
    output gradient that is a transposed view: read through their strides, results as the oracle."""
    gen = torch.Generator().manual_seed(1300)
    packed = torch.randn(2, 9, 80, generator=gen, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(24, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, 24, 9, generator=gen, dtype=torch.float64).transpose(1, 2)
    results = []
    for dtype, fn in ((torch.float32, rmsnorm_gated), (torch.float64, naive_ops.rmsnorm_gated)):
        p, w = packed.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        out = fn(p[..., 10:34], w, z=p[..., 50:74], group_size=12, norm_before_gate=False)
        out.backward(grad.to(dtype))
        results.append((out, p.grad, w.grad))
    for name, got, ref in zip(("out", "grad of packed", "grad of weight"), *results):
        assert torch.isfinite(got).all() and relative_error(got, ref) <= TOL, name


def test_rmsnorm_gated_rejects_group_size_not_dividing_dim():
    with pytest.raises(ValueError, match="group_size"):
        rmsnorm_gated(torch.randn(2, 10), torch.ones(10), group_size=4)
