"""bf16 Triton selective_scan (TRITON_INTERPRET=1 on the CPU) against float64, beside mamba_ssm.

Inputs as Mamba-1 passes them under bf16 autocast: u, delta, B, C, z in bf16; A, D, delta_bias
(float32 parameters) and the context-parallel initial state in float32. mamba_ssm's
selective_scan_ref (its PyTorch stand-in for the CUDA scan) runs on the same values with the same
cotangents. It has no seq_idx or initial_state: those cases are held to float64 with the bar
mamba_ssm sets on the same inputs without documents or initial state (RATIO x its error), and
the float32 gradient of the initial state to float32 round-off (FLOOR). SEQLEN spans two chunks
and ends inside a third; DSTATE is odd; channel blocks are partly masked.
"""

import functools
import math

import pytest
import torch

import naive_ops
from bf16_checks import FLOOR, RATIO, assert_within_theirs, errors
from megamamba.kernels.triton import selective_scan
from megamamba.kernels.triton.selective_scan import CHUNK

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned_buffers")]
BATCH, DIM, DSTATE, GROUPS = 2, 12, 5, 2
SEQLEN = 2 * CHUNK + 13
LAYOUTS = {"model": (BATCH, DSTATE, SEQLEN), "groups": (BATCH, GROUPS, DSTATE, SEQLEN)}
OPTIONS = dict(delta_softplus=True)


def inputs(seed, layout="groups"):
    """Seeded inputs of Mamba-1's scale: dt = softplus(delta + delta_bias) around 1e-3..1e-1."""
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    dt = torch.empty(DIM).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
    bf16 = functools.partial(torch.Tensor.to, dtype=torch.bfloat16)
    return dict(
        u=bf16(r(BATCH, DIM, SEQLEN)),
        delta=bf16(0.5 * r(BATCH, DIM, SEQLEN)),
        A=-torch.exp(2 * torch.rand(DIM, DSTATE, generator=gen)),
        B=bf16(r(*LAYOUTS[layout])),
        C=bf16(r(*LAYOUTS[layout])),
        D=r(DIM),
        z=bf16(r(BATCH, DIM, SEQLEN)),
        delta_bias=dt + torch.log(-torch.expm1(-dt)),
    )


def documents():
    """Row 0: a boundary inside the first chunk, one at the third chunk's start, the first id
    reused; row 1: one document."""
    first, second = 5, 2 * CHUNK - 5
    return torch.tensor([[3] * first + [1] * second + [3] * (SEQLEN - first - second), [0] * SEQLEN], dtype=torch.int32)


def initial_state(seed):
    return torch.randn(BATCH, DIM, DSTATE, generator=torch.Generator().manual_seed(seed + 7))


@functools.lru_cache(maxsize=None)
def plain_errors(scan, seed, layout, last_state):
    """Errors of `scan` (ours or mamba_ssm's) without documents or initial state, with the last
    state as a second output when asked; kept for the tests that share them."""
    names = ("out", "last_state") if last_state else ("out",)
    return errors(
        scan, naive_ops.selective_scan, inputs(seed, layout), seed, names, return_last_state=last_state, **OPTIONS
    )


def measured(theirs, seed, layout, last_state):
    """(ours, mamba_ssm's) plain errors on the same inputs."""
    return plain_errors(selective_scan, seed, layout, last_state), plain_errors(theirs, seed, layout, last_state)


def assert_within_bar(ours, bar, seed):
    """Each quantity finite and at most RATIO x bar[name] (or FLOOR; FLOOR alone where bar has none)."""
    for name, err in ours.items():
        limit = max(RATIO * bar[name], FLOOR) if name in bar else FLOOR
        assert math.isfinite(limit) and err <= limit, (
            f"seed {seed}: {name} error {err:.2e} > {limit:.2e} "
            f"(ours: {' '.join(f'{k} {v:.1e}' for k, v in ours.items())})"
        )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_selective_scan_within_mamba_ssm_error(mamba_ssm, layout):
    """The output and the gradient of every input, B / C as Mamba-1 passes them or in groups."""
    seed = 1000 + sorted(LAYOUTS).index(layout)
    assert_within_theirs(*measured(mamba_ssm.selective_scan_ref, seed, layout, False), seed)


def test_bf16_selective_scan_float32_parameter_gradients_at_float32_round_off(mamba_ssm):
    """dA, dD and d delta_bias sum float32 products of exact bf16 values: float32 round-off, a
    bar far under mamba_ssm's reference (which rounds silu(z) to bf16 before its products)."""
    seed = 1000
    ours = plain_errors(selective_scan, seed, "groups", False)
    for name in ("dA", "dD", "ddelta_bias"):
        assert ours[name] <= FLOOR, f"seed {seed}: {name} error {ours[name]:.2e} > {FLOOR:.0e}"


def test_bf16_selective_scan_last_state_and_its_gradient_within_mamba_ssm_error(mamba_ssm):
    """The float32 last state, and a cotangent flowing into it (as context parallelism's summaries
    get) beside the output's: every gradient within mamba_ssm's error."""
    seed = 1010
    assert_within_theirs(*measured(mamba_ssm.selective_scan_ref, seed, "groups", True), seed)


def test_bf16_selective_scan_documents_within_no_document_bar(mamba_ssm):
    """Packed documents (seq_idx), against float64: within mamba_ssm's error on the same inputs
    without documents."""
    seed = 1020
    ours = errors(selective_scan, naive_ops.selective_scan, dict(inputs(seed), seq_idx=documents()), seed, **OPTIONS)
    assert_within_bar(ours, plain_errors(mamba_ssm.selective_scan_ref, seed, "groups", False), seed)


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_bf16_selective_scan_initial_state_within_no_state_bar(mamba_ssm, with_seq_idx):
    """A float32 initial state (reaching only the first document), the last state out, both with
    gradients: within mamba_ssm's error on the same inputs without them; d initial_state at
    float32 round-off."""
    seed = 1030
    t = dict(inputs(seed), initial_state=initial_state(seed))
    if with_seq_idx:
        t["seq_idx"] = documents()
    ours = errors(
        selective_scan, naive_ops.selective_scan, t, seed, ("out", "last_state"), return_last_state=True, **OPTIONS
    )
    assert_within_bar(ours, plain_errors(mamba_ssm.selective_scan_ref, seed, "groups", True), seed)


def zero_input_scan(scan, B):
    """The contribution of an initial state as megamamba/parallel/context/context_slice.py computes it: the scan
    of a zero input (a stride-0 expanded scalar, in delta's dtype) from initial_state, gated by z.
    B only scales the zero input (its gradient is zero): it is held fixed."""

    def run(delta, A, C, z, delta_bias, initial_state, seq_idx=None):
        zeros = delta.new_zeros(()).expand_as(delta)
        return scan(
            zeros,
            delta,
            A,
            B.to(delta.dtype),
            C,
            z=z,
            delta_bias=delta_bias,
            seq_idx=seq_idx,
            initial_state=initial_state,
            **OPTIONS,
        )

    return run


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_bf16_zero_input_scan_from_initial_state_within_no_state_bar(mamba_ssm, with_seq_idx):
    """Context parallelism's second scan: against float64, within mamba_ssm's error of the plain
    scan on the same inputs; d initial_state at float32 round-off."""
    seed = 1040
    t = {k: v for k, v in inputs(seed).items() if k not in ("u", "B", "D")}
    t["initial_state"] = initial_state(seed)
    if with_seq_idx:
        t["seq_idx"] = documents()
    B = inputs(seed)["B"]
    ours = errors(zero_input_scan(selective_scan, B), zero_input_scan(naive_ops.selective_scan, B), t, seed)
    assert_within_bar(ours, plain_errors(mamba_ssm.selective_scan_ref, seed, "groups", False), seed)
