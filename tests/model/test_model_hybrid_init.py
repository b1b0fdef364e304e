"""Initialisation of hybrids as mamba_ssm's MambaLMHeadModel: linear biases zero; every projection back onto
the residual stream (a mixer's out_proj, an MLP's fc2) kaiming-uniform divided by sqrt(n_layer). Its
MixerModel divides by sqrt(2 n_layer) when d_intermediate puts an MLP in every block, but MambaLMHeadModel
then applies `_init_weights` once more with one residual per layer, which draws these weights again: its
LM's fc2 and out_proj end at the sqrt(n_layer) bound (measured on mamba_ssm 2.3.2.post1: max |fc2| 0.04419
against the bounds 0.04419 for n_layer and 0.03125 for 2 n_layer, d_intermediate 64, n_layer 4)."""

import math

import torch

from megamamba import MambaConfig, MambaLM

ATTN = {"num_heads": 4, "num_heads_kv": 2, "head_dim": 12, "causal": True}  # out_proj fan-in 48
MAMBA2 = {"layer": "Mamba2", "d_state": 6, "headdim": 8, "chunk_size": 8}  # d_inner 96: out_proj fan-in 96


def build(seed, **fields):
    torch.manual_seed(seed)
    return MambaLM(MambaConfig(d_model=48, vocab_size=37, ssm_cfg=MAMBA2, attn_cfg=ATTN, **fields))


def assert_bound(weight, fan_in, depth, what):
    bound = 1 / math.sqrt(fan_in) / math.sqrt(depth)  # kaiming_uniform(a=sqrt 5): 1 / sqrt(fan_in)
    top = weight.abs().max().item()
    assert 0.9 * bound < top <= bound, f"{what}: max |w| {top:.4f}, bound {bound:.4f}"


def test_attention_biases_start_at_zero():
    model = build(51, n_layer=2, attn_layer_idx=[0])
    mixer = model.backbone.layers[0].mixer
    assert torch.equal(mixer.in_proj.bias, torch.zeros(96))  # (4 + 2 x 2) heads of 12
    assert torch.equal(mixer.out_proj.bias, torch.zeros(48))


def test_pattern_layers_rescale_out_proj_and_fc2_by_sqrt_n_layer():
    """One residual branch per layer: out_proj of Mamba and attention layers and fc2 of MLP layers."""
    model = build(52, n_layer=3, hybrid_layer_pattern="M*-", d_intermediate=64)
    mamba, attention, mlp = model.backbone.layers
    assert_bound(mamba.mixer.out_proj.weight, 96, 3, "Mamba out_proj")
    assert_bound(attention.mixer.out_proj.weight, 48, 3, "attention out_proj")
    assert_bound(mlp.mixer.fc2.weight, 64, 3, "MLP fc2")


def test_an_mlp_inside_every_block_is_rescaled_as_the_language_model_rescales_it():
    """d_intermediate with mamba_ssm's fields: mixer.out_proj and mlp.fc2 at the sqrt(n_layer) bound."""
    model = build(53, n_layer=2, attn_layer_idx=[1], d_intermediate=100)  # width rounded up to 128
    for block in model.backbone.layers:
        fan_in = 48 if block.mixer.__class__.__name__ == "Attention" else 96
        assert_bound(block.mixer.out_proj.weight, fan_in, 2, "mixer out_proj")
        assert_bound(block.mlp.fc2.weight, 128, 2, "mlp.fc2")
