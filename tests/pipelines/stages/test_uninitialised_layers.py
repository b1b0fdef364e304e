"""The pipeline's layer specs build their layers without drawing their default initialisation, with the
same parameters (names, shapes, dtypes, marks) as the layers built the DeepSpeed way."""

import dataclasses

import pytest
import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from megamamba import MambaConfig
from megamamba.parallel import TensorParallel
from megamamba.pipelines.stages.pipeline_module import layer_specs
from megamamba.pipelines.stages.uninitialised import UninitialisedLayerSpec
from train_entry import ROOT

CONFIGS = ["launch/models/tiny-mamba1.json", "launch/models/tiny-mamba2.json"]
MARKS = ("tp_shard", "tensor_model_parallel", "partition_dim", "_no_weight_decay", "_no_reinit")


def _config(path: str, tied: bool) -> MambaConfig:
    return dataclasses.replace(MambaConfig.from_json(ROOT / path), n_layer=2, tie_embeddings=tied)


def _tp(size: int):
    """Rank 1 of a TP group of `size` (no collective runs while building), or None."""
    return TensorParallel(group=object(), size=size, rank=1) if size > 1 else None


def _described(module: nn.Module) -> dict:
    return {
        name: (p.shape, p.dtype, p.device, p.requires_grad, {m: getattr(p, m) for m in MARKS if hasattr(p, m)})
        for name, p in module.named_parameters()
    }


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("path", CONFIGS)
def test_layers_have_the_default_builds_parameters_and_marks(path, tied, tp_size):
    for spec in layer_specs(_config(path, tied), _tp(tp_size)):
        assert _described(spec.build()) == _described(LayerSpec.build(spec)), spec


@pytest.mark.parametrize("path", CONFIGS)
def test_building_the_layers_draws_nothing_from_the_random_stream(path):
    specs = layer_specs(_config(path, tied=False), _tp(2))
    before = torch.random.get_rng_state()
    for spec in specs:
        spec.build()
    assert torch.equal(torch.random.get_rng_state(), before)


class _SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.second.weight = self.first.weight


def test_a_parameter_registered_twice_stays_one():
    module = UninitialisedLayerSpec(_SharedWeight).build()
    assert module.second.weight is module.first.weight
    assert module.first.weight.device.type != "meta"


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("positions", torch.arange(4))


def test_a_layer_holding_a_buffer_is_refused_naming_it():
    with pytest.raises(TypeError, match="buffer positions"):
        UninitialisedLayerSpec(_WithBuffer).build()
