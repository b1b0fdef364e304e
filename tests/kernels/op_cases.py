"""The custom ops' arguments for opcheck (tests/kernels/test_custom_ops*.py): every op with each optional
input given, odd sizes, documents, and the views the mixers pass; the backward ops with gradients in other
layouts than the outputs' and absent ones as None."""

import torch

from megamamba.kernels import ops

BATCH, SEQLEN = 2, 13  # seqlen: not a multiple of the chunk (4)
INF = float("inf")


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf requiring grad with t's strides (a view stays a view)."""
    return t.detach().requires_grad_()


def documents():
    seq_idx = torch.zeros(BATCH, SEQLEN, dtype=torch.int32)
    seq_idx[0, 5:] = 1
    seq_idx[1, 9:] = 2
    return seq_idx


def op_cases(gen, views: bool):
    """{name: (op, arguments)}: every forward op with each optional input given; with `views`, x, B, C and
    the gates as slices and transposes of wider tensors, as the mixers pass them."""

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    b, L, h, p, g, n, d = BATCH, SEQLEN, 4, 3, 2, 5, 6
    if views:  # Mamba-2: x, B, C column slices of the conv output (batch, seqlen, h p + 2 g n)
        xbc = r(b, L, h * p + 2 * g * n + 1)
        x, B, C = (
            leaf(t)
            for t in (
                xbc[..., : h * p].view(b, L, h, p),
                xbc[..., h * p : h * p + g * n].view(b, L, g, n),
                xbc[..., h * p + g * n : -1].view(b, L, g, n),
            )
        )
        u = leaf(r(b, L, d).transpose(1, 2))  # Mamba-1: (batch, dim, seqlen) transposes
        conv_x = leaf(r(b, L, 2 * d + 1)[..., : 2 * d].transpose(1, 2))  # channel-last
        gated = leaf(r(b, L, 3 * d)[..., d:])
    else:
        x, B, C, u, conv_x, gated = (
            leaf(r(*s)) for s in ((b, L, h, p), (b, L, g, n), (b, L, g, n), (b, d, L), (b, 2 * d, L), (b, L, 2 * d))
        )
    seq_idx = documents()
    # Mamba-3's preprocessing: rank 2, 2 groups of 2 heads, dstate 8, 3 angles; with `views`, the raw columns are
    # slices of one wider in_proj output, as the mixer passes them.
    rank, groups, heads, dstate, angles = 2, 2, 4, 8, 3
    widths = [rank * groups * dstate] * 2 + [heads] * 3 + [angles]
    if views:
        columns = r(b, L, sum(widths) + 1)[..., :-1].split(widths, dim=-1)
    else:
        columns = tuple(r(b, L, w) for w in widths)
    raw_B, raw_C = (leaf(t.unflatten(-1, (rank, groups, dstate))) for t in columns[:2])
    mamba3_inputs = (
        raw_B, raw_C, *(leaf(t) for t in columns[2:]), leaf(r(heads)), leaf(r(dstate)), leaf(r(dstate)),
        leaf(r(heads, rank, dstate)), leaf(r(heads, rank, dstate)), 1e-4, "heavy_tail", "halves", 1e-5, seq_idx,
        leaf(r(b, heads, angles)), None,
    )  # fmt: skip
    return {
        "mamba3_scan_inputs": (ops.mamba3_scan_inputs, mamba3_inputs),
        "ssd_chunk_scan": (
            ops.ssd_chunk_scan,
            (
                x,
                leaf(r(b, L, h)),
                leaf(-torch.rand(h, generator=gen)),
                B,
                C,
                4,
                leaf(r(h, p)),
                leaf(r(b, L, h, p)),
                leaf(r(h)),
                leaf(r(b, h, p, n)),
                seq_idx,
                True,
                [0.0, INF],
                True,
                None,
            ),
        ),
        "selective_scan": (
            ops.selective_scan,
            (
                u,
                leaf(r(b, d, L)),
                leaf(-torch.rand(d, n, generator=gen)),
                leaf(r(b, 2, n, L)),
                leaf(r(b, 2, n, L)),
                leaf(r(d)),
                leaf(r(b, d, L)),
                leaf(r(d)),
                True,
                True,
                seq_idx,
                leaf(r(b, d, n)),
                None,
            ),
        ),
        "causal_conv1d": (ops.causal_conv1d, (conv_x, leaf(r(2 * d, 4)), leaf(r(2 * d)), seq_idx, "silu", None)),
        "rmsnorm_gated": (
            ops.rmsnorm_gated,
            (gated, leaf(r(2 * d)), leaf(r(2 * d)), leaf(r(b, L, 2 * d)), 1e-5, d, False, None),
        ),
        "add_rmsnorm": (ops.add_rmsnorm, (gated, leaf(r(b, L, 2 * d)), leaf(r(2 * d)), 1e-5, None, None)),
        "selective_state_update": (
            ops.selective_state_update,
            (
                r(b, h, p, n),
                r(b, h, p),
                r(b, h, p),
                -torch.rand(h, p, n, generator=gen),
                r(b, g, n),
                r(b, g, n),
                r(h, p),
                r(b, h, p),
                r(h, p),
                True,
            ),
        ),
        "causal_conv1d_update": (ops.causal_conv1d_update, (r(b, d), r(b, d, 4), r(d, 4), r(d), "silu")),
    }


def backward_cases(gen):
    """{name: (backward op, arguments)}: gradients in other layouts than the outputs', absent ones as None."""

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    b, L, h, p, g, n = BATCH, SEQLEN, 4, 3, 2, 5
    scan = (r(b, 6, L), r(b, 6, L), -torch.rand(6, n, generator=gen), r(6, n), r(b, 1, n, L), None, r(b, 6, L), None)
    initial_state = r(b, 6, n)
    chunk_states = ops.selective_scan(*scan, False, False, None, initial_state, None)[2]  # Triton's, or empty
    scan_options = (False, None, initial_state, chunk_states, None)
    rank, groups, heads, dstate, angles = 1, 1, 2, 6, 3
    per_head = (b, L, heads)
    mamba3_inputs = (
        r(b, L, rank, groups, dstate), r(b, L, rank, groups, dstate), *(r(*per_head) for _ in range(3)),
        r(b, L, angles), r(heads), r(dstate), r(dstate), r(heads, rank, dstate), r(heads, rank, dstate), 0.5,
        "softplus", "adjacent", 1e-5, documents(), None, None,
    )  # fmt: skip
    mamba3_grads = (
        r(b, L, heads, rank, dstate).transpose(0, 1).contiguous().transpose(0, 1), None, r(*per_head), None,
        r(*per_head), r(b, L, heads, angles),
    )  # fmt: skip
    return {
        "mamba3_scan_inputs_backward": (
            ops.mamba3_scan_inputs_backward,
            (*mamba3_grads, torch.rand(b, L, heads, angles, generator=gen) * 6, *mamba3_inputs),
        ),
        "ssd_chunk_scan_backward": (
            ops.ssd_chunk_scan_backward,
            (
                r(b, h, L, p).transpose(1, 2),
                None,
                r(b, L, h, p),
                r(b, L, h),
                -torch.rand(h, generator=gen),
                r(b, L, g, n),
                r(b, L, g, n),
                4,
                r(h),
                None,
                r(h),
                None,
                documents(),
                True,
                [0.05, 2.0],
                None,
            ),
        ),
        "selective_scan_backward": (ops.selective_scan_backward, (r(b, 6, L), r(b, 6, n), *scan, *scan_options)),
        "causal_conv1d_backward": (
            ops.causal_conv1d_backward,
            (r(b, L, 6).transpose(1, 2), r(b, 6, L), r(6, 3), None, None, None, None),
        ),
        "rmsnorm_gated_backward": (
            ops.rmsnorm_gated_backward,
            (r(b, L, 8), r(b, L, 8), r(8), None, r(b, L, 8), 1e-5, 4, True, None),
        ),
        "add_rmsnorm_backward": (
            ops.add_rmsnorm_backward,
            (r(b, L, 8), r(b, L, 8).double(), r(b, L, 8), None, r(8), r(b, L, 8).double(), 1e-5, torch.float64, None),
        ),
    }
