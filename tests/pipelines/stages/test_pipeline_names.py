"""Pipeline parameter names <-> mamba_ssm names: a bijection over every parameter, tied or not."""

import dataclasses

import pytest

from megamamba import MambaConfig, MambaLM
from megamamba.pipelines.stages.names import to_mamba, to_pipe

CONFIGS = ["launch/models/tiny-mamba1.json", "launch/models/tiny-mamba2.json"]


def _config(path, **changes):
    return dataclasses.replace(MambaConfig.from_json(path), **changes)


@pytest.mark.parametrize("path", CONFIGS)
@pytest.mark.parametrize("tied", [True, False])
def test_every_mamba_name_round_trips_through_the_pipeline_name(path, tied):
    config = _config(path, n_layer=3, tie_embeddings=tied)
    names = list(MambaLM(config).state_dict())
    for name in names:
        assert to_mamba(to_pipe(name, config), config) in (name, "backbone.embedding.weight"), name
    pipe_names = {to_pipe(n, config) for n in names}
    assert len(pipe_names) == len(names) - (1 if tied else 0)  # lm_head.weight is the tied embedding


def test_names_follow_the_global_layer_index():
    config = _config(CONFIGS[1], n_layer=5)
    assert to_pipe("backbone.embedding.weight", config) == "tied_modules.embed.weight"
    assert to_pipe("lm_head.weight", config) == "tied_modules.embed.weight"
    assert to_pipe("backbone.layers.0.mixer.in_proj.weight", config) == "1.mixer.in_proj.weight"
    assert to_pipe("backbone.layers.4.norm.weight", config) == "5.norm.weight"
    assert to_pipe("backbone.norm_f.weight", config) == "6.weight"
    untied = _config(CONFIGS[1], n_layer=5, tie_embeddings=False)
    assert to_pipe("backbone.embedding.weight", untied) == "0.weight"
    assert to_pipe("lm_head.weight", untied) == "7.weight"
    assert to_mamba("7.weight", untied) == "lm_head.weight"


@pytest.mark.parametrize("name", ["backbone.layers.5.norm.weight", "backbone.nope", "decoder.weight"])
def test_names_outside_the_model_are_refused(name):
    with pytest.raises(KeyError, match="not a parameter"):
        to_pipe(name, _config(CONFIGS[0], n_layer=5))


@pytest.mark.parametrize("name", ["8.weight", "0.weight", "6.mixer.A_log", "tied_modules.head.weight", "x.weight"])
def test_pipeline_names_outside_the_model_are_refused(name):
    with pytest.raises(KeyError):
        to_mamba(name, _config(CONFIGS[0], n_layer=5))
