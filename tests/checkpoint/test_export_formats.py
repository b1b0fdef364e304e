"""Which formats a model exports to, known from its config: every reason at once, never a circle.

`export_refusals` lists, for mamba_ssm and transformers' Mamba, Mamba2 and NemotronH, every reason
each cannot compute a model; `convert export` refuses with all of them in one line (exit 2, nothing
written) and points to the other target only when that one can. Every model config under
launch/models exports to its transformers class (slow test: logits and log-probs equal ours, in
tiny shapes) or its start-up line names why not.
"""

import json
from pathlib import Path

import pytest
import torch

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from convert_cli import convert, refused
from megamamba.checkpoint.export_formats import (
    MAMBA,
    MAMBA2,
    MAMBA_SSM,
    NEMOTRON_H,
    export_refusals,
    exports_line,
    transformers_format,
)
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.config import MambaConfig
from megamamba.testing.numerics import relative_error

MODELS = Path(__file__).resolve().parents[2] / "launch" / "models"
QUICKSTART_PATTERN = "M*M-"  # scripts/quickstart.sh's, as the README runs it
GATED_ROTARY_BIASED = {  # what the hybrid quick start used to be: neither NemotronH nor mamba_ssm computes it
    "n_layer": 4,
    "hybrid_layer_pattern": QUICKSTART_PATTERN,
    "d_intermediate": 20,
    "attn_cfg": {"num_heads": 6, "num_heads_kv": 2, "head_dim": 6, "rotary_emb_dim": 4, "causal": True},
}


def launch_config(name: str) -> MambaConfig:
    """launch/models/NAME.json as train.py builds it (the quick start's hybrid with the README's pattern)."""
    fields = json.loads((MODELS / f"{name}.json").read_text())
    if name == "quickstart-hybrid":
        fields["hybrid_layer_pattern"] = QUICKSTART_PATTERN
    return MambaConfig.from_dict(fields)


def test_every_reason_of_every_format_is_listed_not_the_first():
    refusals = export_refusals(tiny("Mamba2", **GATED_ROTARY_BIASED))
    assert [r.setting for r in refusals[NEMOTRON_H]] == [
        "attn_cfg qkv_proj_bias=True, out_proj_bias=True",
        "attn_cfg.rotary_emb_dim=4",
        "mlp_activation='gated_silu'",
    ]
    assert [r.setting for r in refusals[MAMBA_SSM]] == ["MLP layers (-)"]
    assert [r.setting for r in refusals[MAMBA] + refusals[MAMBA2]] == ["attention or MLP layers"] * 2


def test_a_mamba_only_model_exports_to_mamba_ssm_and_its_transformers_class():
    assert exports_line(tiny("Mamba1")) == "exports to: mamba_ssm, transformers Mamba"
    assert exports_line(tiny("Mamba2")) == "exports to: mamba_ssm, transformers Mamba2"
    assert exports_line(tiny("Mamba2", rms_norm=False)) == (
        "exports to: mamba_ssm (not transformers Mamba2: rms_norm=false (LayerNorm))"
    )


def test_export_to_hf_refuses_with_every_reason_in_one_line_and_sends_nowhere_that_refuses_too(tmp_path):
    save_model_folder(perturbed_model(tiny("Mamba2", **GATED_ROTARY_BIASED), 0), str(tmp_path / "ours"))
    before = snapshot(str(tmp_path))
    line = refused(
        ["export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf"],
        r"^convert export: error: --to hf: transformers NemotronH cannot compute this model: "
        r"attn_cfg qkv_proj_bias=True, out_proj_bias=True: .*; attn_cfg.rotary_emb_dim=4: .*; "
        r"mlp_activation='gated_silu': .*; nor can --to mamba_ssm: MLP layers \(-\): mamba_ssm has no MLP layers",
    )
    assert snapshot(str(tmp_path)) == before
    assert not line.endswith(" can")


def test_export_to_mamba_ssm_refuses_naming_the_nemotron_h_reasons_too(tmp_path):
    save_model_folder(perturbed_model(tiny("Mamba2", **GATED_ROTARY_BIASED), 0), str(tmp_path / "ours"))
    before = snapshot(str(tmp_path))
    refused(
        ["export", "--to", "mamba_ssm", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "ssm"],
        r"^convert export: error: --to mamba_ssm: mamba_ssm cannot compute this model: MLP layers \(-\): .*; "
        r"nor can --to hf \(transformers NemotronH\): attn_cfg qkv_proj_bias=True, .*mlp_activation='gated_silu'",
    )
    assert snapshot(str(tmp_path)) == before


def test_export_to_hf_points_to_mamba_ssm_when_mamba_ssm_can(tmp_path):
    config = tiny(
        "Mamba2", n_layer=3, attn_layer_idx=[1], attn_cfg={"num_heads": 3, "rotary_emb_dim": 4, "causal": True}
    )
    save_model_folder(perturbed_model(config, 0), str(tmp_path / "ours"))
    refused(
        ["export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf"],
        r"^convert export: error: --to hf: transformers NemotronH cannot compute this model: .*"
        r"attn_cfg.rotary_emb_dim=4: NemotronH's attention has no rotary embedding \(use 0\); --to mamba_ssm can$",
    )


def test_every_launch_model_config_exports_to_its_transformers_class_or_its_start_up_line_says_why():
    for path in sorted(MODELS.glob("*.json")):
        config = launch_config(path.stem)
        fmt, line = transformers_format(config), exports_line(config)
        refusals = export_refusals(config)[fmt]
        if refusals:
            assert f"{fmt}: {'; '.join(r.setting for r in refusals)}" in line, path.name
        else:
            assert fmt in line.split(" (not ")[0], path.name


def test_the_start_up_lines_of_the_launch_model_configs():
    assert exports_line(launch_config("quickstart-hybrid")) == (
        "exports to: transformers NemotronH (not mamba_ssm: MLP layers (-))"
    )
    assert exports_line(launch_config("nemotron-h-8b")) == (
        "exports to: transformers NemotronH (not mamba_ssm: MLP layers (-))"
    )
    assert exports_line(launch_config("tiny-hybrid")) == (  # a test model of what NemotronH lacks
        "exports to: none (mamba_ssm: MLP layers (-) | transformers NemotronH: attn_cfg qkv_proj_bias=True, "
        "out_proj_bias=True; attn_cfg.rotary_emb_dim=8; mlp_activation='gated_silu')"
    )
    assert exports_line(launch_config("mamba2-130m")) == "exports to: mamba_ssm, transformers Mamba2"


def tiny_shapes(config: MambaConfig) -> MambaConfig:
    """`config`'s options at a width of 32, each kind of layer once, 37 ids (padded as the config pads), 8 experts of
    width 16."""
    if config.d_model <= 128:
        return config
    f = config.to_dict()
    f.update(d_model=32, vocab_size=37, n_layer=2)
    if config.hybrid_layer_pattern:
        f["hybrid_layer_pattern"] = "".join(dict.fromkeys(config.layer_pattern))
        f["n_layer"] = len(f["hybrid_layer_pattern"])
    ssm = {**f["ssm_cfg"], "d_state": 8}
    if config.layer == "Mamba2":
        ssm.update(headdim=16, chunk_size=16, ngroups=min(ssm.get("ngroups", 1), 2))
    f["ssm_cfg"] = ssm
    if config.d_intermediate:
        f["d_intermediate"] = 48
    if f.get("attn_cfg"):
        f["attn_cfg"] = {**f["attn_cfg"], "num_heads": 4, "num_heads_kv": 2, "head_dim": 8}
    if f.get("moe_cfg"):
        moe = f["moe_cfg"]
        shared = 16 if moe.get("shared_expert_ffn_hidden_size") else 0
        f["moe_cfg"] = {
            **moe,
            "num_experts": 8,
            "top_k": 2,
            "ffn_hidden_size": 16,
            "shared_expert_ffn_hidden_size": shared,
        }
    return MambaConfig.from_dict(f)


def exportable_families() -> dict:
    """{the first launch/models config of each distinct tiny-shaped config: it} of those that export to transformers."""
    families: dict = {}
    for path in sorted(MODELS.glob("*.json")):
        config = tiny_shapes(launch_config(path.stem))
        if not export_refusals(config)[transformers_format(config)] and config not in families.values():
            families[path.stem] = config
    return families


@pytest.mark.slow
@pytest.mark.parametrize("name", exportable_families())
def test_each_launch_model_family_exports_to_transformers_with_our_log_probs(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model = perturbed_model(exportable_families()[name], 3).eval()  # padding rows non-zero, as after training
    save_model_folder(model, str(tmp_path / "ours"))
    convert("export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "hf")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info
    assert type(theirs).__name__ == transformers_format(model.config).split()[-1] + "ForCausalLM"
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ours, logits = model(ids)[..., :vocab], theirs.eval()(ids).logits
    assert logits.shape == ours.shape  # the real vocabulary: no padding column in transformers' softmax
    logits_err = relative_error(logits, ours)
    log_prob_err = (logits.log_softmax(-1) - ours.log_softmax(-1)).abs().max().item()
    print(f"{name}: logits relative error {logits_err:.2e}, log-probs max |difference| {log_prob_err:.2e}")
    assert logits_err <= 1e-5 and log_prob_err <= 1e-5, (name, logits_err, log_prob_err)
