import pytest
import torch


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Every Triton-written buffer starts as NaN, so an element a kernel forgot to write fails the check."""
    from megamamba.kernels.triton import common

    monkeypatch.setattr(
        common, "empty", lambda shape, *, device, dtype: torch.full(shape, float("nan"), device=device, dtype=dtype)
    )


@pytest.fixture(scope="module")
def mamba_ssm():
    """mamba_ssm's kernels and references (tests/mamba_ssm_source.py), with the CPU stand-ins they
    need in place for the test module; its tests skip, saying why, when its source release is absent."""
    import mamba_ssm_source

    with mamba_ssm_source.loaded() as (theirs, why):
        if theirs is None:
            pytest.skip(why)
        yield theirs
