"""The pipeline's layer list, and the model's own forward with recomputation, compute the single-device model's
loss and gradients.

Here the layer specs are built and chained in one process, named as DeepSpeed names them
(`<index>.<name>`, `tied_modules.embed.*`); the multi-rank tests run the real PipelineModule.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from megamamba import MambaConfig, MambaLM
from megamamba.model.lm import layer_list
from megamamba.model.loss import training_loss
from megamamba.model.stream import Stream
from megamamba.pipelines.stages.names import load_mamba_state_dict, mamba_state_dict, to_mamba
from megamamba.pipelines.stages.pipeline_module import layer_specs
from megamamba.testing.numerics import relative_error

CONFIGS = ["launch/models/tiny-mamba1.json", "launch/models/tiny-mamba2.json"]
SEED = 11


class ChainedSpecs(nn.Module):
    """All layers of `layer_specs` on one rank, registered under DeepSpeed's names."""

    def __init__(self, config):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.funcs = []
        for idx, spec in enumerate(layer_specs(config)):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.funcs.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
            else:
                module = spec.build()
                self.add_module(str(idx), module)
                self.funcs.append(module)

    def forward(self, ids, seq_idx=None):
        x = Stream(ids, seq_idx)
        for f in self.funcs:
            x = f(x)
        return x


def _setup(path, tied=True):
    config = dataclasses.replace(MambaConfig.from_json(path), n_layer=3, tie_embeddings=tied)
    torch.manual_seed(SEED)
    model = MambaLM(config)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config.vocab_size, (2, 29), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 29), generator=g)
    return config, model, ids, labels


def _reference(model, config, ids, labels):
    loss = F.cross_entropy(model(ids)[..., : config.vocab_size].flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_the_pipeline_specs_are_the_models_own_layer_list(tied):
    config, model, _, _ = _setup(CONFIGS[1], tied)
    types = [type(layer) for layer in layer_list(model)]
    specs = layer_specs(config)
    assert [spec.typename for spec in specs[:-1]] == types[:-1]
    assert specs[-1].typename is (types[0] if tied else types[-1])  # a tied head is the embedding layer


def test_the_chained_pipeline_layers_give_the_models_logits_bit_for_bit():
    config, model, ids, _ = _setup(CONFIGS[0])
    chain = ChainedSpecs(config)
    load_mamba_state_dict(chain, model.state_dict(), config)
    with torch.no_grad():
        assert torch.equal(chain(ids), model(ids)), f"seed {SEED}"


@pytest.mark.parametrize(
    "path, tied",
    [
        (CONFIGS[1], True),
        pytest.param(CONFIGS[0], False, marks=pytest.mark.slow),
        pytest.param(CONFIGS[0], True, marks=pytest.mark.slow),
        pytest.param(CONFIGS[1], False, marks=pytest.mark.slow),
    ],
)
def test_chained_pipeline_layers_match_the_single_device_model(path, tied):
    config, model, ids, labels = _setup(path, tied)
    ref_loss, ref_grads = _reference(model, config, ids, labels)
    chain = ChainedSpecs(config)
    load_mamba_state_dict(chain, model.state_dict(), config)
    loss = training_loss(chain(ids), labels, config.vocab_size)
    loss.backward()
    assert torch.isfinite(loss)
    assert relative_error(loss.detach(), ref_loss) <= 1e-6, f"seed {SEED}"
    for name, p in chain.named_parameters():
        assert relative_error(p.grad, ref_grads[to_mamba(name, config)]) <= 1e-5, (name, f"seed {SEED}")


def test_the_stage_state_dict_comes_back_under_mamba_ssm_names():
    config, model, _, _ = _setup(CONFIGS[1])
    chain = ChainedSpecs(config)
    load_mamba_state_dict(chain, model.state_dict(), config)
    state = mamba_state_dict(chain, config)
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_loading_a_state_dict_that_lacks_a_parameter_names_it():
    config, model, _, _ = _setup(CONFIGS[0])
    state = model.state_dict()
    del state["backbone.layers.2.mixer.A_log"]
    with pytest.raises(KeyError, match="backbone.layers.2.mixer.A_log"):
        load_mamba_state_dict(ChainedSpecs(config), state, config)


@pytest.mark.parametrize(
    "path, interval",
    [
        (CONFIGS[1], 0),
        pytest.param(CONFIGS[1], 2, marks=pytest.mark.slow),
        pytest.param(CONFIGS[0], 2, marks=pytest.mark.slow),
        pytest.param(CONFIGS[0], 1, marks=pytest.mark.slow),
    ],
)
def test_the_models_training_loss_matches_with_and_without_activation_checkpointing(path, interval):
    config, model, ids, labels = _setup(path)
    ref_loss, ref_grads = _reference(model, config, ids, labels)
    ref_grads = {n: g.clone() for n, g in ref_grads.items()}
    model.zero_grad()
    model.checkpoint_interval = interval
    loss = model(ids, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert relative_error(loss.detach(), ref_loss) <= 1e-6, f"seed {SEED}"
    for name, p in model.named_parameters():
        assert relative_error(p.grad, ref_grads[name]) <= 1e-5, (name, interval, f"seed {SEED}")


def _packed_seq_idx(seqlen, seed):
    """(2, seqlen) int32 document ids with several boundaries per row, at different places in each row."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(2, seqlen, generator=g) < 0.15
    return starts.cumsum(dim=1).to(torch.int32)


@pytest.mark.parametrize("path", [CONFIGS[1], pytest.param(CONFIGS[0], marks=pytest.mark.slow)])
def test_seq_idx_reaches_every_block_of_the_chained_layers_and_of_the_recomputed_model(path):
    config, model, ids, labels = _setup(path)
    seq_idx = _packed_seq_idx(ids.shape[1], SEED)
    ref_logits = model(ids, seq_idx=seq_idx).detach()
    # the resets matter: the checks below can fail
    assert 1e-2 < relative_error(model(ids).detach(), ref_logits) < float("inf")
    ref_loss, ref_grads = _reference_packed(model, config, ids, labels, seq_idx)
    chain = ChainedSpecs(config)
    load_mamba_state_dict(chain, model.state_dict(), config)
    logits = chain(ids, seq_idx.long()).detach()  # int64, as it may travel between stages
    assert torch.isfinite(logits).all()
    assert relative_error(logits, ref_logits) <= 1e-6, f"seed {SEED}"
    model.zero_grad()
    model.checkpoint_interval = 2
    loss = model(ids, labels, seq_idx)
    loss.backward()
    assert relative_error(loss.detach(), ref_loss) <= 1e-6, f"seed {SEED}"
    for name, p in model.named_parameters():
        assert relative_error(p.grad, ref_grads[name]) <= 1e-5, (name, f"seed {SEED}")


def _reference_packed(model, config, ids, labels, seq_idx):
    model.zero_grad()
    loss = F.cross_entropy(model(ids, seq_idx=seq_idx)[..., : config.vocab_size].flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
