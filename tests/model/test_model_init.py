"""Initialisation as mamba_ssm's: dt range, S4D / uniform A, D = 1, LM-level rescale, ties, weight-decay marks."""

import math

import pytest
import torch
import torch.nn.functional as F

from megamamba import MambaLM


def mixers(model):
    return [layer.mixer for layer in model.backbone.layers]


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_dt_at_init_lies_in_dt_min_dt_max_above_the_floor(tiny_config, layer):
    torch.manual_seed(31)
    # Half of the log-uniform range lies below the floor, so the clamp is exercised.
    cfg = tiny_config(layer, {"dt_min": 1e-4, "dt_max": 1e-2, "dt_init_floor": 1e-3}, n_layer=4)
    dts = []
    for m in mixers(MambaLM(cfg)):
        dts.append(F.softplus(m.dt_proj.bias if layer == "Mamba1" else m.dt_bias).detach())
    dt = torch.cat(dts)
    assert torch.isfinite(dt).all()
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-2 * (1 + 1e-5), (dt.min(), dt.max())
    assert ((dt - 1e-3).abs() < 1e-8).any(), "no dt was clamped to the floor"
    assert (dt > 2e-3).any(), "dt is not spread over the range"


def test_mamba1_A_is_minus_one_to_d_state_per_channel_and_D_is_one(tiny_config):
    cfg = tiny_config("Mamba1")
    for m in mixers(MambaLM(cfg)):
        expected = -torch.arange(1, 6, dtype=torch.float32).repeat(36, 1)
        assert torch.allclose(-torch.exp(m.A_log), expected, rtol=1e-6)
        assert torch.equal(m.D, torch.ones(36))


def test_mamba1_dt_proj_weight_init(tiny_config):
    torch.manual_seed(32)
    std = 3**-0.5 * 0.5  # dt_rank 3, dt_scale 0.5
    w = MambaLM(tiny_config("Mamba1", {"dt_scale": 0.5})).backbone.layers[0].mixer.dt_proj.weight
    assert w.abs().max() <= std and w.abs().max() > 0.8 * std
    constant = MambaLM(tiny_config("Mamba1", {"dt_scale": 0.5, "dt_init": "constant"}))
    assert torch.allclose(constant.backbone.layers[0].mixer.dt_proj.weight, torch.full((36, 3), std))


def test_mamba2_A_uniform_in_A_init_range_and_D_is_one(tiny_config):
    torch.manual_seed(33)
    cfg = tiny_config("Mamba2", {"A_init_range": [2, 5]}, n_layer=6)
    A = torch.cat([-torch.exp(m.A_log.detach()) for m in mixers(MambaLM(cfg))])
    assert A.shape == (36,) and A.min() >= -5 - 1e-5 and A.max() <= -2 + 1e-5
    assert A.max() - A.min() > 1.0, "A is not spread over the range"
    assert all(torch.equal(m.D, torch.ones(6)) for m in mixers(MambaLM(cfg)))


def test_mamba2_conv_init_bounds_the_conv_weights(tiny_config):
    w = MambaLM(tiny_config("Mamba2", {"conv_init": 0.01})).backbone.layers[0].mixer.conv1d.weight
    assert w.abs().max() <= 0.01


@pytest.mark.parametrize("layer,marked", [("Mamba1", {"A_log", "D"}), ("Mamba2", {"A_log", "D", "dt_bias"})])
def test_no_weight_decay_marks(tiny_config, layer, marked):
    mixer = MambaLM(tiny_config(layer)).backbone.layers[0].mixer
    got = {n for n, p in mixer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert got == marked


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_linear_biases_zero_except_dt_proj(tiny_config, layer):
    model = MambaLM(tiny_config(layer, {"bias": True}))
    for m in mixers(model):
        assert torch.equal(m.in_proj.bias, torch.zeros_like(m.in_proj.bias))
        assert torch.equal(m.out_proj.bias, torch.zeros_like(m.out_proj.bias))
        if layer == "Mamba1":
            assert (m.dt_proj.bias != 0).all()


def test_embedding_std_and_out_proj_rescaled_by_sqrt_n_layer(tiny_config):
    torch.manual_seed(34)
    cfg = tiny_config("Mamba2", d_model=48, vocab_size=600, n_layer=9)
    model = MambaLM(cfg)
    std = model.backbone.embedding.weight.std().item()
    assert abs(std - 0.02) < 0.001, std
    bound = 1 / math.sqrt(96) / math.sqrt(9)  # kaiming_uniform(a=sqrt 5) over fan_in d_inner, / sqrt(n_layer)
    for m in mixers(model):
        w = m.out_proj.weight.abs().max().item()
        assert 0.9 * bound < w <= bound, (w, bound)


def test_tied_head_shares_the_embedding_storage(tiny_config):
    model = MambaLM(tiny_config("Mamba1"))
    assert model.lm_head.weight is model.backbone.embedding.weight
    assert model.lm_head.weight.data_ptr() == model.backbone.embedding.weight.data_ptr()
    untied = MambaLM(tiny_config("Mamba1", tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.backbone.embedding.weight.data_ptr()


@pytest.mark.parametrize("layer,fp32", [("Mamba1", {"A_log", "D"}), ("Mamba2", {"D"})])
def test_parameter_dtypes_follow_mamba_ssm(tiny_config, layer, fp32):
    model = MambaLM(tiny_config(layer), dtype=torch.bfloat16)
    mixer = model.backbone.layers[0].mixer
    got = {n for n, p in mixer.named_parameters() if p.dtype == torch.float32}
    assert got == fp32
    logits = model(torch.randint(0, 37, (2, 9)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize("layer,tied", [("Mamba1", True), ("Mamba2", False)])
def test_each_layer_drawn_alone_equals_the_whole_model_bit_for_bit(tiny_config, layer, tied):
    from megamamba.model.layers import draw_seed, initial_layer

    cfg = tiny_config(layer, {}, n_layer=3, tie_embeddings=tied)
    torch.manual_seed(5)
    whole = MambaLM(cfg).state_dict()
    torch.manual_seed(5)
    seed = draw_seed()
    layers = {}
    for index in reversed(range(cfg.n_layer + (2 if cfg.tie_embeddings else 3))):  # any order
        layers.update(initial_layer(cfg, index, seed))
    assert sorted(layers) == sorted(whole)
    assert [n for n in whole if not torch.equal(layers[n], whole[n])] == []


def test_building_a_model_takes_one_draw_from_the_global_stream(tiny_config):
    cfg = tiny_config("Mamba2", {}, n_layer=2)
    torch.manual_seed(9)
    MambaLM(cfg)
    after_model = torch.rand(3)
    torch.manual_seed(9)
    torch.randint(0, 2**62, (), dtype=torch.int64)
    assert torch.equal(torch.rand(3), after_model)


def test_a_model_built_on_the_meta_device_leaves_the_global_stream_alone(tiny_config):
    torch.manual_seed(9)
    with torch.device("meta"):
        MambaLM(tiny_config("Mamba2", {}, n_layer=2))
    MambaLM(tiny_config("Mamba1", {}), device="meta")
    after = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(torch.rand(3), after)
