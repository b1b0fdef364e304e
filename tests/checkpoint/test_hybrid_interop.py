"""Hybrid models (attention and MLP layers beside Mamba-2) to and from transformers' NemotronH and mamba_ssm.

Fast tests: the NemotronH export round trip, what it refuses, and what training's --init-from reads
from either folder. Slow tests load the folders with transformers' NemotronHForCausalLM (its PyTorch
path) and with mamba_ssm's MambaLMHeadModel (its Triton kernels under the interpreter, extension
stubbed: tests/mamba_ssm_source.py; mamba_ssm's rotary needs flash_attn, absent here, so its
attention runs without rotary) and compare logits with ours in float32.
"""

import json
import math

import pytest
import torch

from checkpoint_fixtures import assert_equal_but_the_vocabulary_padding, perturbed_model, tiny
from convert_cli import convert, refused
from megamamba.checkpoint import config_differences
from megamamba.checkpoint.hf import HFFormatError
from megamamba.checkpoint.model_folder import FolderWeights, load_model_folder, save_model_folder
from megamamba.checkpoint.nemotron_h import config_from_nemotron_h, nemotron_h_config
from megamamba.testing.numerics import relative_error
from megamamba.tokenizer import load_tokenizer

NO_BIAS = {"qkv_proj_bias": False, "out_proj_bias": False}
GQA = {"num_heads": 6, "num_heads_kv": 2, "head_dim": 5, "causal": True}  # 3 query heads per key/value head
# a Nemotron-H-shaped pattern: Mamba-2, attention, squared-ReLU MLP layers
PATTERN = {
    "n_layer": 5,
    "hybrid_layer_pattern": "M*-M-",
    "d_intermediate": 22,
    "mlp_activation": "squared_relu",
    "attn_cfg": {**GQA, **NO_BIAS},
    "vocab_size": 257,
}
NEMOTRON_CASES = {
    "tied": ({}, {}),
    # NemotronH clamps dt at time_step_min, its initialisation minimum too; the stream in the model's dtype
    "untied_dt_floor_bias": (
        {"dt_limit": [0.05, math.inf], "dt_min": 0.05, "bias": True},
        {"tie_embeddings": False, "residual_in_fp32": False},
    ),
    # multi-head attention, its head width d_model / num_heads left implicit (the import spells it out)
    "mha_implicit_head_dim": ({}, {"attn_cfg": {"num_heads": 6, "causal": True, **NO_BIAS}}),
}


def pattern_model(case: str, seed: int = 3):
    ssm, fields = NEMOTRON_CASES[case]
    return perturbed_model(tiny("Mamba2", ssm=ssm, **{**PATTERN, **fields}), seed)


def exported(tmp_path, model, to: str = "hf") -> str:
    save_model_folder(model, str(tmp_path / "ours"), tokenizer=load_tokenizer("bytes"))
    convert("export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / to, "--to", to)
    return str(tmp_path / to)


def ids_for(model, batch: int = 2, seed: int = 11) -> torch.Tensor:
    """Token ids (batch, 13): two chunks of the tiny Mamba-2, the second partial."""
    return torch.randint(0, model.config.vocab_size, (batch, 13), generator=torch.Generator().manual_seed(seed))


# ---- transformers' NemotronH -------------------------------------------------------------


@pytest.mark.parametrize("case", NEMOTRON_CASES)
def test_nemotron_h_export_then_import_gives_our_config_and_weights_but_the_padding_rows(tmp_path, case):
    model = pattern_model(case)
    folder = exported(tmp_path, model)
    hf = json.loads(open(f"{folder}/config.json").read())
    assert hf["model_type"] == "nemotron_h" and hf["architectures"] == ["NemotronHForCausalLM"]
    assert hf["layers_block_type"] == ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]
    assert hf["time_step_min"] == model.config.mixer_options.dt_limit[0] and hf["eos_token_id"] == 256
    convert("import", "--from", "hf", "--input", folder, "--output", tmp_path / "back")
    back = load_model_folder(str(tmp_path / "back"))
    assert hf["vocab_size"] == 257 and config_differences(back.config, model.config) == []
    assert_equal_but_the_vocabulary_padding(back.state_dict(), model.state_dict(), model.config)
    assert load_tokenizer(str(tmp_path / "back")).identity == load_tokenizer("bytes").identity


@pytest.mark.parametrize(
    "change, named",
    [
        ({"mlp_activation": "gated_silu"}, r"mlp_activation='gated_silu': NemotronH's MLP is squared ReLU"),
        ({"attn_cfg": GQA}, r"qkv_proj_bias=True, out_proj_bias=True: NemotronH's attention has no biases"),
        (
            {"attn_cfg": {**GQA, **NO_BIAS, "rotary_emb_dim": 2}},
            r"rotary_emb_dim=2: NemotronH's attention has no rotary",
        ),
        ({"attn_cfg": {**GQA, **NO_BIAS, "softmax_scale": 0.3}}, r"softmax_scale=0.3: NemotronH scales by head_dim"),
        ({"ssm_cfg": {"layer": "Mamba1"}}, r"ssm_cfg.layer='Mamba1': NemotronH's Mamba layers are Mamba2"),
        (
            {"ssm_cfg": {"layer": "Mamba2", "headdim": 6, "dt_limit": [0.0, 1.0]}},
            r"dt_limit=\[0.0, 1.0\]: .*upper limit",
        ),
        ({"ssm_cfg": {"layer": "Mamba2", "headdim": 6, "norm_before_gate": True}}, r"norm_before_gate=True"),
        ({"rms_norm": False}, r"rms_norm=false \(LayerNorm\): NemotronH has RMSNorm only"),
        (
            {"hybrid_layer_pattern": "", "n_layer": 2, "attn_layer_idx": [1], "mlp_activation": "squared_relu"},
            r"d_intermediate=22 without hybrid_layer_pattern .* one mixer per layer",
        ),
    ],
)
def test_nemotron_h_export_refuses_what_it_cannot_compute(change, named):
    config = tiny("Mamba2", **{**PATTERN, **{k: v for k, v in change.items() if k != "ssm_cfg"}})
    if "ssm_cfg" in change:
        config = type(config).from_dict({**config.to_dict(), "ssm_cfg": change["ssm_cfg"]})
    with pytest.raises(HFFormatError, match=named):
        nemotron_h_config(config, torch.float32)


def test_nemotron_h_refusal_is_one_line_naming_the_field(tmp_path):
    model = perturbed_model(tiny("Mamba2", **{**PATTERN, "attn_cfg": GQA}), 0)
    save_model_folder(model, str(tmp_path / "ours"))
    refused(
        ["export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf"],
        r"^convert export: error: --to hf: transformers NemotronH cannot compute this model: "
        r"attn_cfg qkv_proj_bias=True, out_proj_bias=True: NemotronH",
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "change, named",
    [
        ({"layers_block_type": ["linear_attention", "retention"]}, r"layers_block_type has \['retention'\]"),
        ({"layers_block_type": None, "hybrid_override_pattern": "MR"}, r"layers_block_type has \['R'\]"),
        ({"num_nextn_predict_layers": 1}, r"num_nextn_predict_layers=1: multi-token prediction"),
        ({"mlp_hidden_act": "silu"}, r"mlp_hidden_act='silu'"),
    ],
)
def test_nemotron_h_import_refuses_what_we_cannot_compute(change, named):
    hf = {**nemotron_h_config(tiny("Mamba2", **PATTERN), torch.float32), **change}
    with pytest.raises(HFFormatError, match=named):
        config_from_nemotron_h(hf)


def test_nemotron_h_import_reads_the_older_config_names_transformers_reads():
    config = tiny("Mamba2", **PATTERN)
    hf = nemotron_h_config(config, torch.float32)
    del hf["layers_block_type"]
    older = {
        "hybrid_override_pattern": "M*-M-",
        "mamba_n_groups": hf.pop("n_groups"),
        "mamba_chunk_size": hf.pop("chunk_size"),
        **hf,
    }
    assert config_from_nemotron_h(older) == config_from_nemotron_h(nemotron_h_config(config, torch.float32))
    types = ["mamba", "attention", "mlp", "mamba", "mlp"]  # the layer type names transformers remaps
    renamed = {**nemotron_h_config(config, torch.float32), "layers_block_type": types}
    assert config_from_nemotron_h(renamed) == config_from_nemotron_h(older)


def test_init_from_reads_a_nemotron_h_folder_as_our_tensors(tmp_path):
    model = pattern_model("untied_dt_floor_bias")
    weights = FolderWeights(exported(tmp_path, model))
    assert weights.kind == "transformers NemotronHForCausalLM folder"
    ours = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert weights.shapes() == ours  # the vocabulary's padding rows counted in
    assert_equal_but_the_vocabulary_padding(weights.tensors(sorted(ours)), model.state_dict(), model.config)


@pytest.mark.slow
@pytest.mark.parametrize("case", NEMOTRON_CASES)
def test_transformers_nemotron_h_logits_of_the_export_equal_ours(tmp_path, case, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model = pattern_model(case).eval()
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(exported(tmp_path, model), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    ids = ids_for(model)
    with torch.no_grad():
        ours, theirs = model(ids), hf.eval()(ids).logits
    ours = ours[..., : model.config.vocab_size]  # the export holds the real vocabulary's rows only
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    err = relative_error(theirs, ours)
    print(f"{case}: NemotronHForCausalLM vs ours (float32) {err:.2e}")
    assert err <= 1e-5, f"{case}: relative error {err:.2e} (model seed 3, ids seed 11)"


# ---- mamba_ssm ---------------------------------------------------------------------------

# mamba_ssm's fields: attention at layer 1 (GQA, biases), a gated MLP inside every block. Its fused path
# needs the causal-conv1d extension (use_mem_eff_path); its Triton norms cost seconds interpreted (fused_add_norm).
FOR_THE_CPU = {"ssm_cfg": {"use_mem_eff_path": False}, "fused_add_norm": False}
MAMBA_SSM_HYBRID = {
    "d_model": 18,
    "n_layer": 3,
    "vocab_size": 37,
    "d_intermediate": 20,
    "attn_layer_idx": [1],
    "attn_cfg": {**GQA, "qkv_proj_bias": True, "out_proj_bias": True},
    "tie_embeddings": False,
    "fused_add_norm": False,
    "ssm_cfg": {
        "layer": "Mamba2",
        "d_state": 6,
        "headdim": 6,
        "ngroups": 2,
        "chunk_size": 8,
        "use_mem_eff_path": False,
    },
}


def test_mamba_ssm_export_refuses_mlp_layers_naming_the_pattern_and_nemotron_h(tmp_path):
    save_model_folder(pattern_model("tied"), str(tmp_path / "ours"))
    refused(
        ["export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "ssm", "--to", "mamba_ssm"],
        r"MLP layers \(-\): mamba_ssm has no MLP layers of their own .*hybrid_layer_pattern='M\*-M-'\); "
        r"--to hf \(transformers NemotronH\) can$",
    )


def test_mamba_ssm_export_writes_its_config_and_init_from_reads_it_back(tmp_path):
    model = perturbed_model(tiny("Mamba2", n_layer=3, hybrid_layer_pattern="M*M", attn_cfg=GQA), 0)
    folder = exported(tmp_path, model, "mamba_ssm")
    fields = json.loads(open(f"{folder}/config.json").read())
    assert fields["attn_layer_idx"] == [1] and "hybrid_layer_pattern" not in fields and "mlp_activation" not in fields
    weights = FolderWeights(folder)
    assert weights.kind == "mamba_ssm folder (pytorch_model.bin)"
    read = weights.tensors(sorted(model.state_dict()))
    assert all(torch.equal(read[n], t) for n, t in model.state_dict().items())


@pytest.fixture(scope="module")
def mamba_ssm():
    import mamba_ssm_source

    with mamba_ssm_source.loaded() as (theirs, why):
        if theirs is None:
            pytest.skip(why)
        yield theirs


@pytest.mark.slow
def test_a_mamba_ssm_hybrid_folder_gives_its_logits_in_ours(tmp_path, mamba_ssm):
    torch.manual_seed(5)
    theirs = mamba_ssm.MambaLMHeadModel(mamba_ssm.MambaConfig(**MAMBA_SSM_HYBRID), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(str(tmp_path / "ssm"))  # config.json + pytorch_model.bin, as published
    convert("import", "--from", "mamba_ssm", "--input", tmp_path / "ssm", "--output", tmp_path / "ours")
    ours = load_model_folder(str(tmp_path / "ours"))
    assert ours.config.to_dict() == json.loads(open(tmp_path / "ssm" / "config.json").read())
    ids = ids_for(ours, batch=1)  # interpreted, each of its Triton programs costs milliseconds
    with torch.no_grad():
        err = relative_error(ours(ids), theirs.eval()(ids).logits)
    print(f"mamba_ssm MambaLMHeadModel (attn_layer_idx, GQA, d_intermediate) vs ours: {err:.2e}")
    assert err <= 1e-5, f"relative error {err:.2e} (model seed 5, ids seed 11)"


@pytest.mark.slow
def test_mamba_ssm_reads_our_hybrid_export_with_our_logits(tmp_path, mamba_ssm):
    config = tiny(
        "Mamba2", ssm=FOR_THE_CPU["ssm_cfg"], fused_add_norm=False, n_layer=3, hybrid_layer_pattern="M*M", attn_cfg=GQA
    )
    model = perturbed_model(config, 2).eval()
    theirs = mamba_ssm.MambaLMHeadModel.from_pretrained(exported(tmp_path, model, "mamba_ssm"), device="cpu")
    ids = ids_for(model, batch=1)
    with torch.no_grad():
        err = relative_error(theirs.eval()(ids).logits, model(ids))
    print(f"our pattern hybrid read by mamba_ssm's from_pretrained vs ours: {err:.2e}")
    assert err <= 1e-5, f"relative error {err:.2e} (model seed 2, ids seed 11)"
