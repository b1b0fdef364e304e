"""param_groups: decay for matrices (embedding included), none for SSM parameters, biases and norms."""

import pytest
import torch

from megamamba import MambaLM
from megamamba.optim import param_groups

NO_DECAY = {
    "Mamba1": {"A_log", "D", "conv1d.bias", "dt_proj.bias", "in_proj.bias", "out_proj.bias"},
    "Mamba2": {"A_log", "D", "dt_bias", "conv1d.bias", "norm.weight", "in_proj.bias", "out_proj.bias"},
}
DECAY = {
    "Mamba1": {"in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight"},
    "Mamba2": {"in_proj.weight", "conv1d.weight", "out_proj.weight"},
}


def names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_groups_split_parameters_by_the_decay_rule(tiny_config, layer):
    model = MambaLM(tiny_config(layer, {"bias": True}, n_layer=1))
    decay, no_decay = param_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    mixer = "backbone.layers.0.mixer."
    expected_decay = {"backbone.embedding.weight"} | {mixer + n for n in DECAY[layer]}
    expected_no_decay = {"backbone.layers.0.norm.weight", "backbone.norm_f.weight"} | {
        mixer + n for n in NO_DECAY[layer]
    }
    assert names(model, decay["params"]) == expected_decay
    assert names(model, no_decay["params"]) == expected_no_decay


def test_tied_weight_appears_once_and_untied_head_decays(tiny_config):
    tied = MambaLM(tiny_config("Mamba1"))
    params = [p for g in param_groups(tied, 0.1) for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(tied.parameters()))
    untied = MambaLM(tiny_config("Mamba1", tie_embeddings=False))
    assert "lm_head.weight" in names(untied, param_groups(untied, 0.1)[0]["params"])


def test_frozen_parameters_are_left_out(tiny_config):
    model = MambaLM(tiny_config("Mamba2"))
    model.backbone.embedding.weight.requires_grad_(False)
    grouped = {id(p) for g in param_groups(model, 0.1) for p in g["params"]}
    assert id(model.backbone.embedding.weight) not in grouped


def test_adamw_accepts_the_groups_and_decays_only_the_first(tiny_config):
    model = MambaLM(tiny_config("Mamba2", n_layer=1))
    opt = torch.optim.AdamW(param_groups(model, 0.5), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only weight decay moves a parameter
    opt.step()
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (p.dim() >= 2), n
