"""The public ops pick the backend from MEGAMAMBA_KERNELS and the device at each call; helpers they share."""

import inspect
from types import SimpleNamespace

import pytest
import torch

import megamamba.kernels as kernels
from megamamba.kernels import choice, dispatch, ops


def call_arguments():
    """For each dispatched op: its arguments, every one given a non-default value (a distinct object)."""
    t = {name: torch.zeros(1, 2, 3) for name in ("u", "delta", "z", "x")}
    return {
        "selective_scan": dict(
            u=t["u"],
            delta=t["delta"],
            A=torch.zeros(2, 4),
            B=torch.zeros(1, 1, 4, 3),
            C=torch.zeros(1, 1, 4, 3),
            D=torch.zeros(2),
            z=t["z"],
            delta_bias=torch.ones(2),
            delta_softplus=True,
            return_last_state=True,
            seq_idx=torch.zeros(1, 3, dtype=torch.int32),
            initial_state=torch.ones(1, 2, 4),
        ),
        "ssd_chunk_scan": dict(
            x=torch.zeros(1),
            dt=torch.zeros(1),
            A=torch.zeros(1),
            B=torch.zeros(1),
            C=torch.zeros(1),
            chunk_size=7,
            D=torch.zeros(1),
            z=torch.zeros(1),
            dt_bias=torch.ones(1),
            initial_states=torch.ones(1, 1),
            seq_idx=torch.zeros(1, 1, dtype=torch.int32),
            dt_softplus=True,
            dt_limit=(0.1, 9.0),
            return_final_states=True,
        ),
        "causal_conv1d": dict(
            x=t["x"],
            weight=torch.zeros(1),
            bias=torch.zeros(1),
            seq_idx=torch.zeros(1, 1, dtype=torch.int32),
            activation="silu",
        ),
        "rmsnorm_gated": dict(
            x=t["x"],
            weight=torch.zeros(1),
            bias=torch.zeros(1),
            z=torch.zeros(1),
            eps=1e-3,
            group_size=1,
            norm_before_gate=False,
        ),
    }


TRITON_MODULES = {
    "selective_scan": "selective_scan",
    "ssd_chunk_scan": "ssd",
    "causal_conv1d": "conv",
    "rmsnorm_gated": "norm",
}


class Called(Exception):
    """Raised by a stand-in backend: which one ran, with what (it passes out of the custom op unchanged)."""


@pytest.fixture
def fakes(monkeypatch):
    """Replace both backends of every dispatched op by stand-ins that raise `Called`."""

    def recorder(backend, fn):
        def fake(*args, **kwargs):
            raise Called(backend, inspect.signature(fn).bind(*args, **kwargs).arguments)

        return fake

    stand_ins = {}
    for name, module in TRITON_MODULES.items():
        forward = choice.triton(module).forward
        stand_ins[module] = SimpleNamespace(forward=recorder("triton", forward))
        monkeypatch.setattr(ops, f"reference_{name}", recorder("reference", getattr(ops, f"reference_{name}")))
    monkeypatch.setattr(ops, "triton", lambda module: stand_ins[module])


def called(name, arguments):
    """(backend, the arguments it received by name) when the public op `name` runs with `arguments`."""
    with pytest.raises(Called) as raised:
        getattr(kernels, name)(**arguments)
    return raised.value.args


@pytest.mark.parametrize("setting", ["reference", "auto", "", None])
def test_cpu_tensors_use_the_reference_unless_triton_is_forced(setting, fakes, monkeypatch):
    if setting is None:
        monkeypatch.delenv("MEGAMAMBA_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MEGAMAMBA_KERNELS", setting)
    for name, arguments in call_arguments().items():
        assert called(name, arguments)[0] == "reference", name


@pytest.mark.parametrize("setting", ["reference", "triton"])
def test_every_argument_reaches_the_backend(setting, fakes, monkeypatch):
    """Each public argument arrives under its own name: the same tensor, the same value (the scans'
    return flags are the ops' own business: they always compute the final state)."""
    monkeypatch.setenv("MEGAMAMBA_KERNELS", setting)
    for name, arguments in call_arguments().items():
        backend, received = called(name, arguments)
        assert backend == setting, name
        for key, value in arguments.items():
            if key in ("return_last_state", "return_final_states"):
                continue
            got, expected = received[key], list(value) if isinstance(value, tuple) else value
            assert got is value or (not isinstance(value, torch.Tensor) and got == expected), f"{name}: {key}"


def test_the_choice_is_read_at_each_call(fakes, monkeypatch):
    arguments = call_arguments()["rmsnorm_gated"]
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    assert called("rmsnorm_gated", arguments)[0] == "triton"
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    assert called("rmsnorm_gated", arguments)[0] == "reference"


def test_auto_picks_triton_for_cuda_tensors(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "auto")
    assert dispatch.backend(SimpleNamespace(is_cuda=True)) == "triton"
    assert dispatch.backend(torch.zeros(1)) == "reference"


def test_an_invalid_setting_is_refused_naming_the_variable_and_choices(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"MEGAMAMBA_KERNELS='cuda' is not one of auto, reference, triton"):
        kernels.causal_conv1d(torch.zeros(1, 1, 3), torch.zeros(1, 2))


def test_step_ops_are_the_reference_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    x = torch.ones(1, 2)
    assert kernels.causal_conv1d_update(x, torch.zeros(1, 2, 3), torch.ones(2, 3)).tolist() == [[1.0, 1.0]]


def test_reference_through_the_public_api_computes(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    x = torch.tensor([[[1.0, 2.0, 3.0]]])
    assert kernels.causal_conv1d(x, torch.tensor([[1.0, 1.0]])).tolist() == [[[1.0, 3.0, 5.0]]]


def test_document_counters_are_computed_once_per_seq_idx_and_redone_after_a_change():
    from megamamba.kernels.triton import common

    seq_idx = torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.int32)
    first = common.document_counters(seq_idx, 1, 5)
    assert first.tolist() == [[0, 0, 1, 1, 2]]
    assert common.document_counters(seq_idx, 1, 5) is first
    seq_idx[0, 1] = 3
    assert common.document_counters(seq_idx, 1, 5).tolist() == [[0, 1, 2, 2, 3]]
    other = seq_idx.clone()
    assert common.document_counters(other, 1, 5) is not common.document_counters(seq_idx, 1, 5)
