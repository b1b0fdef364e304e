"""The custom ops on Triton (the CPU: its interpreter): torch.library.opcheck passes for every op and its
backward op, so the fake implementations give what the Triton kernels return (its chunk states, its float32
final states, the conv's channel-last layout)."""

import pytest
import torch

from op_cases import backward_cases, op_cases

pytestmark = pytest.mark.slow  # the interpreter


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")


def test_every_op_passes_opcheck_on_triton():
    """On the views the mixers pass (the reference's test covers compact inputs too)."""
    seed = 41
    for name, (op, args) in op_cases(torch.Generator().manual_seed(seed), views=True).items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: {name} {results}"


def test_every_backward_op_passes_opcheck_on_triton():
    seed = 43
    for name, (op, args) in backward_cases(torch.Generator().manual_seed(seed)).items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, f"seed {seed}: {name} {results}"
