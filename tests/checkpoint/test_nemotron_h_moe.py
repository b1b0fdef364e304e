"""Mixture-of-experts hybrids (E layers) to and from transformers' NemotronH ("moe" layers).

Fast tests: the config and weight mapping both ways, and what the export and import refuse. Slow tests load
transformers' NemotronHForCausalLM (its PyTorch path, float32): a random NemotronH-MoE model of its own
imported gives its logits in ours, and our export gives ours in it; both with a non-zero expert bias, a
routed scaling factor of 2.5, a shared expert and group-limited routing.
"""

import json

import pytest
import torch
from safetensors import safe_open

from checkpoint_fixtures import assert_equal_but_the_vocabulary_padding, perturbed_model, snapshot, tiny
from convert_cli import convert, refused
from megamamba.checkpoint import config_differences
from megamamba.checkpoint.export_formats import NEMOTRON_H, export_refusals
from megamamba.checkpoint.hf import HFFormatError
from megamamba.checkpoint.model_folder import FolderWeights, load_model_folder, save_model_folder
from megamamba.checkpoint.nemotron_h import config_from_nemotron_h, nemotron_h_config
from megamamba.testing.numerics import relative_error

NO_BIAS = {"qkv_proj_bias": False, "out_proj_bias": False}
MOE = {  # NemotronH's routing: sigmoid scores, 2 of 8 experts from the best of 2 groups, scaled by 2.5
    "num_experts": 8,
    "top_k": 2,
    "ffn_hidden_size": 8,
    "shared_expert_ffn_hidden_size": 12,
    "activation": "relu2",
    "score_function": "sigmoid",
    "expert_bias": True,
    "routed_scaling_factor": 2.5,
    "n_group": 2,
    "topk_group": 1,
    "aux_loss_coeff": 1e-3,
    "aux_loss_type": "seq_aux_loss",
}
CASES = {
    "expert_bias": MOE,
    # no bias of ours: the export writes NemotronH's as zeros; no groups, weights not normalised
    "no_expert_bias": {**MOE, "expert_bias": False, "n_group": 1, "norm_topk_prob": False},
}


def moe_model(case: str, seed: int = 3):
    config = tiny(
        "Mamba2",
        d_model=24,  # rows of 16-byte multiples, as transformers' grouped experts (torch._grouped_mm) need
        n_layer=4,
        hybrid_layer_pattern="ME*E",
        attn_cfg={"num_heads": 6, "num_heads_kv": 2, "head_dim": 5, "causal": True, **NO_BIAS},
        moe_cfg=CASES[case],
    )
    return perturbed_model(config, seed)  # the expert bias, a parameter, perturbed too


def exported(tmp_path, model) -> str:
    save_model_folder(model, str(tmp_path / "ours"))
    convert("export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf")
    return str(tmp_path / "hf")


def ids_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 13), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("case", CASES)
def test_moe_export_then_import_gives_our_config_and_weights_but_the_padding_rows(tmp_path, case):
    model = moe_model(case)
    folder = exported(tmp_path, model)
    hf = json.loads(open(f"{folder}/config.json").read())
    assert hf["layers_block_type"] == ["linear_attention", "moe", "full_attention", "moe"]
    o = model.config.moe_options
    assert (hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (8, 2, 8)
    assert (hf["moe_shared_expert_intermediate_size"], hf["routed_scaling_factor"]) == (12, 2.5)
    assert (hf["n_group"], hf["topk_group"], hf["norm_topk_prob"]) == (o.n_group, 1, o.norm_topk_prob)
    convert("import", "--from", "hf", "--input", folder, "--output", tmp_path / "back")
    back = load_model_folder(str(tmp_path / "back"))
    assert config_differences(back.config, model.config) == []
    assert_equal_but_the_vocabulary_padding(back.state_dict(), model.state_dict(), model.config)


def test_the_export_holds_each_experts_matrices_and_a_zero_bias_where_ours_has_none(tmp_path):
    model = moe_model("no_expert_bias")
    weights = FolderWeights(exported(tmp_path, model))
    with safe_open(f"{tmp_path}/hf/model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("backbone.layers.1.mixer.experts.7.down_proj.weight"),
            model.state_dict()["backbone.layers.1.mixer.experts.down_proj"][7],
        )
        assert not f.get_tensor("backbone.layers.3.mixer.gate.e_score_correction_bias").any()
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}  # the tied head once, as the embedding
    assert weights.shapes() == ours  # what --init-from reads: our tensors, the zero biases none of them


def test_a_nemotron_h_folder_without_our_moe_settings_imports_with_the_bias_updated():
    hf = nemotron_h_config(moe_model("no_expert_bias").config, torch.float32)
    del hf["moe_cfg"]  # a folder transformers wrote
    o = config_from_nemotron_h(hf).moe_options
    assert o.expert_bias and o.aux_loss_coeff == 0 and o.score_function == "sigmoid" and o.activation == "relu2"


def test_export_refusals_list_every_moe_setting_nemotron_h_cannot_compute():
    moe = {**MOE, "activation": "gated_silu", "score_function": "softmax", "shared_expert_ffn_hidden_size": 0}
    config = moe_model("expert_bias").config
    config = type(config).from_dict({**config.to_dict(), "moe_cfg": {**moe, "capacity_factor": 1.25}})
    assert [r.setting for r in export_refusals(config)[NEMOTRON_H]] == [
        "moe_cfg.activation='gated_silu'",
        "moe_cfg.score_function='softmax'",
        "moe_cfg.shared_expert_ffn_hidden_size=0 (no shared expert)",
        "moe_cfg.capacity_factor=1.25",
    ]


def test_the_moe_export_refusal_is_one_line_and_writes_nothing(tmp_path):
    model = moe_model("expert_bias")
    config = type(model.config).from_dict({**model.config.to_dict(), "moe_cfg": {**MOE, "score_function": "softmax"}})
    save_model_folder(perturbed_model(config, 0), str(tmp_path / "ours"))
    before = snapshot(str(tmp_path))
    refused(
        ["export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf"],
        r"^convert export: error: --to hf: transformers NemotronH cannot compute this model: "
        r"moe_cfg.score_function='softmax': NemotronH scores each expert by its sigmoid \(\"sigmoid\"\); "
        r"nor can --to mamba_ssm: E layers in hybrid_layer_pattern: mamba_ssm has Mamba and attention layers only$",
    )
    assert snapshot(str(tmp_path)) == before


def test_nemotron_h_import_refuses_experts_in_a_latent_projection():
    hf = {**nemotron_h_config(moe_model("expert_bias").config, torch.float32), "moe_latent_size": 6}
    with pytest.raises(HFFormatError, match=r"^moe_latent_size=6: experts working in a latent projection"):
        config_from_nemotron_h(hf)


# ---- transformers' NemotronHForCausalLM ----------------------------------------------------

THEIRS = {  # transformers' own field names: Mamba-2, MoE, attention, MoE layers
    "vocab_size": 37,
    "hidden_size": 24,
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
    "mamba_num_heads": 8,
    "mamba_head_dim": 6,
    "n_groups": 2,
    "ssm_state_size": 6,
    "chunk_size": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 5,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "moe_shared_expert_intermediate_size": 12,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "layer_norm_epsilon": 1e-5,
}


@pytest.mark.slow
def test_a_transformers_nemotron_h_moe_model_imports_with_its_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    theirs = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**THEIRS)).eval()
    with torch.no_grad():
        for name, tensor in (*theirs.named_parameters(), *theirs.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * torch.randn_like(tensor))  # large enough to change which experts are chosen
            elif tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn_like(tensor))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    convert("import", "--from", "hf", "--input", tmp_path / "theirs", "--output", tmp_path / "ours")
    ours = load_model_folder(str(tmp_path / "ours")).eval()
    ids = ids_for(37)
    with torch.no_grad():
        expected = theirs(ids).logits
        err = relative_error(ours(ids), expected)
        for layer in (1, 3):
            theirs.model.layers[layer].mixer.gate.e_score_correction_bias.zero_()
        without_bias = relative_error(theirs(ids).logits, expected)
    print(f"NemotronH-MoE imported: ours vs theirs (float32) {err:.2e}; theirs without the bias {without_bias:.2e}")
    assert without_bias > 1e-3  # the bias decides experts here: a dropped bias would show
    assert err <= 1e-5, f"relative error {err:.2e} (model seed 5, ids seed 11)"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_transformers_nemotron_h_logits_of_our_moe_export_equal_ours(tmp_path, monkeypatch, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model = moe_model(case).eval()
    theirs, info = transformers.NemotronHForCausalLM.from_pretrained(
        exported(tmp_path, model), output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    ids = ids_for(model.config.vocab_size)
    with torch.no_grad():
        ours, logits = model(ids)[..., : model.config.vocab_size], theirs.eval()(ids).logits
    assert logits.dtype == torch.float32 and logits.shape == ours.shape
    err = relative_error(logits, ours)
    print(f"{case}: NemotronHForCausalLM vs ours (float32) {err:.2e}")
    assert err <= 1e-5, f"{case}: relative error {err:.2e} (model seed 3, ids seed 11)"
