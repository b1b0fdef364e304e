"""The public ops pick the backend from MEGAMAMBA_KERNELS and the device; helpers they share."""
import inspect
from types import SimpleNamespace

import pytest
import torch

import megamamba.kernels as kernels
import megamamba.kernels.triton as triton_ops
from megamamba.kernels import dispatch
from megamamba.kernels.reference import step

SENTINEL = object()


def call_arguments():
    """For each dispatched op: its arguments, every one given a non-default value (a distinct object)."""
    t = {name: torch.zeros(1) for name in ("u", "delta", "A", "B", "C", "D", "z", "x", "dt", "weight", "bias")}
    return {
        "selective_scan": dict(u=t["u"], delta=t["delta"], A=t["A"], B=t["B"], C=t["C"], D=t["D"], z=t["z"],
                               delta_bias=torch.ones(1), delta_softplus=True, return_last_state=True,
                               seq_idx=torch.zeros(1, 1, dtype=torch.int32), initial_state=torch.ones(1, 1, 1)),
        "ssd_chunk_scan": dict(x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"], chunk_size=7, D=t["D"],
                               z=t["z"], dt_bias=torch.ones(1), initial_states=torch.ones(1, 1),
                               seq_idx=torch.zeros(1, 1, dtype=torch.int32), dt_softplus=True,
                               dt_limit=(0.1, 9.0), return_final_states=True),
        "causal_conv1d": dict(x=t["x"], weight=t["weight"], bias=t["bias"],
                              seq_idx=torch.zeros(1, 1, dtype=torch.int32), activation="silu"),
        "rmsnorm_gated": dict(x=t["x"], weight=t["weight"], bias=t["bias"], z=t["z"], eps=1e-3, group_size=1,
                              norm_before_gate=False),
    }


@pytest.fixture
def fakes(monkeypatch):
    """Replace both backends of every dispatched op by recorders; returns {(backend, name): calls}."""
    calls = {}

    def recorder(backend, name):
        def fake(*args, **kwargs):
            calls.setdefault((backend, name), []).append((args, kwargs))
            return SENTINEL
        return fake

    for name in call_arguments():
        monkeypatch.setattr(triton_ops, name, recorder("triton", name), raising=False)
        monkeypatch.setattr(dispatch, f"reference_{name}", recorder("reference", name))
    return calls


def bound(name, args, kwargs):
    """The recorded call bound to the public signature: {argument: value}."""
    return dict(inspect.signature(getattr(kernels, name)).bind(*args, **kwargs).arguments)


@pytest.mark.parametrize("setting", ["reference", "auto", "", None])
def test_cpu_tensors_use_the_reference_unless_triton_is_forced(setting, fakes, monkeypatch):
    if setting is None:
        monkeypatch.delenv("MEGAMAMBA_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MEGAMAMBA_KERNELS", setting)
    for name, arguments in call_arguments().items():
        assert getattr(kernels, name)(**arguments) is SENTINEL
    assert set(fakes) == {("reference", name) for name in call_arguments()}


def test_forced_triton_calls_the_triton_op_of_the_same_name_with_every_argument(fakes, monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    for name, arguments in call_arguments().items():
        assert getattr(kernels, name)(**arguments) is SENTINEL
        [(args, kwargs)] = fakes.pop(("triton", name))
        received = bound(name, args, kwargs)
        assert received.keys() == arguments.keys(), name
        assert all(received[k] is v for k, v in arguments.items()), name
    assert not fakes


def test_the_choice_is_read_at_each_call(fakes, monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    kernels.rmsnorm_gated(x, x)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    kernels.rmsnorm_gated(x, x)
    assert set(fakes) == {("triton", "rmsnorm_gated"), ("reference", "rmsnorm_gated")}


def test_auto_picks_triton_for_cuda_tensors(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "auto")
    assert dispatch.backend(SimpleNamespace(is_cuda=True)) == "triton"
    assert dispatch.backend(torch.zeros(1)) == "reference"


def test_an_invalid_setting_is_refused_naming_the_variable_and_choices(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"MEGAMAMBA_KERNELS='cuda' is not one of auto, reference, triton"):
        kernels.causal_conv1d(torch.zeros(1, 1, 3), torch.zeros(1, 2))


def test_a_missing_triton_op_is_reported(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    monkeypatch.delattr(triton_ops, "causal_conv1d", raising=False)
    with pytest.raises(NotImplementedError, match="megamamba.kernels.triton has no causal_conv1d"):
        kernels.causal_conv1d(torch.zeros(1, 1, 3), torch.zeros(1, 2))


def test_step_ops_are_the_reference_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    assert kernels.selective_state_update is step.selective_state_update
    assert kernels.causal_conv1d_update is step.causal_conv1d_update
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
