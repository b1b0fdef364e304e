"""Single-token steps, run token by token, reproduce the full-sequence ops."""

import pytest
import torch

from megamamba.kernels.reference.conv import causal_conv1d
from megamamba.kernels.reference.selective_scan import selective_scan
from megamamba.kernels.reference.ssd import ssd_chunk_scan
from megamamba.kernels.reference.step import causal_conv1d_update, selective_state_update
from megamamba.testing.numerics import relative_error

TOL = 1e-10  # float64 throughout


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@torch.no_grad()
def test_mamba1_steps_reproduce_selective_scan():
    gen = torch.Generator().manual_seed(51)
    batch, dim, seqlen, dstate, groups = 2, 6, 11, 4, 3
    u, delta, z = randn(gen, batch, dim, seqlen), randn(gen, batch, dim, seqlen), randn(gen, batch, dim, seqlen)
    A = -torch.rand(dim, dstate, generator=gen, dtype=torch.float64)
    B, C = randn(gen, batch, groups, dstate, seqlen), randn(gen, batch, groups, dstate, seqlen)
    D, bias = randn(gen, dim), randn(gen, dim)
    full, last = selective_scan(u, delta, A, B, C, D, z, bias, delta_softplus=True, return_last_state=True)
    state = torch.zeros(batch, dim, dstate, dtype=torch.float64)
    steps = torch.stack(
        [
            selective_state_update(
                state, u[..., t], delta[..., t], A, B[..., t], C[..., t], D, z[..., t], bias, dt_softplus=True
            )
            for t in range(seqlen)
        ],
        -1,
    )
    assert relative_error(steps, full) <= TOL, f"seed 51: outputs {relative_error(steps, full):.2e}"
    assert relative_error(state, last) <= TOL, f"seed 51: state {relative_error(state, last):.2e}"


@torch.no_grad()
def test_mamba2_steps_with_broadcast_views_reproduce_ssd():
    gen = torch.Generator().manual_seed(52)
    batch, seqlen, nheads, headdim, ngroups, dstate = 2, 11, 4, 3, 2, 5
    x, z = randn(gen, batch, seqlen, nheads, headdim), randn(gen, batch, seqlen, nheads, headdim)
    dt, dt_bias = randn(gen, batch, seqlen, nheads), randn(gen, nheads)
    A, D = -torch.rand(nheads, generator=gen, dtype=torch.float64), randn(gen, nheads)
    B, C = randn(gen, batch, seqlen, ngroups, dstate), randn(gen, batch, seqlen, ngroups, dstate)
    initial = randn(gen, batch, nheads, headdim, dstate)
    full, final = ssd_chunk_scan(
        x, dt, A, B, C, 4, D=D, z=z, dt_bias=dt_bias, initial_states=initial, dt_softplus=True, return_final_states=True
    )
    state = initial.clone()
    per_head = (nheads, headdim)
    steps = torch.stack(
        [
            selective_state_update(
                state,
                x[:, t],
                dt[:, t, :, None].expand(batch, *per_head),
                A[:, None, None].expand(*per_head, dstate),
                B[:, t],
                C[:, t],
                D=D[:, None].expand(per_head),
                z=z[:, t],
                dt_bias=dt_bias[:, None].expand(per_head),
                dt_softplus=True,
            )
            for t in range(seqlen)
        ],
        1,
    )
    assert relative_error(steps, full) <= TOL, f"seed 52: outputs {relative_error(steps, full):.2e}"
    assert relative_error(state, final) <= TOL, f"seed 52: state {relative_error(state, final):.2e}"


@torch.no_grad()
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_steps_reproduce_causal_conv1d(activation):
    gen = torch.Generator().manual_seed(53)
    batch, dim, seqlen, width = 2, 5, 9, 4
    x, weight, bias = randn(gen, batch, dim, seqlen), randn(gen, dim, width), randn(gen, dim)
    full = causal_conv1d(x, weight, bias, activation=activation)
    conv_state = torch.zeros(batch, dim, width, dtype=torch.float64)
    steps = torch.stack(
        [causal_conv1d_update(x[..., t], conv_state, weight, bias, activation) for t in range(seqlen)], -1
    )
    assert relative_error(steps, full) <= TOL, f"seed 53: outputs {relative_error(steps, full):.2e}"
    assert torch.equal(conv_state, x[..., -width:])


def test_conv_step_refuses_state_of_other_width():
    with pytest.raises(ValueError, match=r"conv_state must have shape \(batch, dim, width\) = \(1, 3, 4\)"):
        causal_conv1d_update(torch.zeros(1, 3), torch.zeros(1, 3, 3), torch.zeros(3, 4))


def test_mamba2_step_refuses_A_of_other_shape():
    state, x = torch.zeros(1, 4, 3, 5), torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match=r"A must have shape \(nheads, headdim, dstate\) = \(4, 3, 5\)"):
        selective_state_update(state, x, x, torch.zeros(4), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
