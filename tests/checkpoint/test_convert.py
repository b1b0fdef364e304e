"""`python -m megamamba.checkpoint.convert`: export to transformers' format, import from it and from mamba_ssm.

Fast tests: round trips, file handling and refusals, without importing transformers. The
transformers tests (slow: importing it takes seconds) load the exported folder with
`MambaForCausalLM` / `Mamba2ForCausalLM` on the CPU (their PyTorch paths, no CUDA kernels) and
compare the logits with ours.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_fixtures import assert_equal_but_the_vocabulary_padding, perturbed_model, snapshot, tiny
from convert_cli import convert, refused
from megamamba.checkpoint import config_differences, model_tensors, save_checkpoint
from megamamba.checkpoint.hf import HFFormatError, config_from_hf, hf_config
from megamamba.checkpoint.model_folder import load_model_folder, save_model_folder
from megamamba.testing.numerics import relative_error
from megamamba.tokenizer import Bytes, load_tokenizer

CASES = {
    "mamba1_tied": ("Mamba1", {}, {}),
    "mamba1_untied_bias": ("Mamba1", {"bias": True, "conv_bias": False}, {"tie_embeddings": False}),
    "mamba2_tied": ("Mamba2", {}, {}),
    "mamba2_untied_dt_limit": ("Mamba2", {"dt_limit": [0.001, 0.5], "bias": True}, {"tie_embeddings": False}),
}


def checkpoint_of(tmp_path, case: str, seed: int = 0, tokenizer=None):
    layer, ssm, fields = CASES[case]
    config = tiny(layer, ssm=ssm, **fields)
    model = perturbed_model(config, seed)
    save_checkpoint(str(tmp_path / "ckpt"), 5, config, model_tensors(model), tokenizer=tokenizer)
    return model, str(tmp_path / "ckpt")


@pytest.mark.parametrize("case", CASES)
def test_export_then_import_gives_our_config_and_bit_identical_weights_but_the_padding_rows(tmp_path, case):
    model, ckpt = checkpoint_of(tmp_path, case)
    convert("export", "--checkpoint", ckpt, "--output", tmp_path / "hf")
    convert("import", "--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ours")
    back = load_model_folder(str(tmp_path / "ours"))
    assert config_differences(back.config, model.config) == []
    assert_equal_but_the_vocabulary_padding(back.state_dict(), model.state_dict(), model.config)
    convert("export", "--checkpoint", tmp_path / "ours", "--output", tmp_path / "again")
    again, first = snapshot(str(tmp_path / "again")), snapshot(str(tmp_path / "hf"))
    del again["README.md"], first["README.md"]  # the card's training section: a model folder records no run
    assert again == first  # nothing else the export holds changed


def test_export_writes_transformers_names_and_fields(tmp_path):
    _, ckpt = checkpoint_of(tmp_path, "mamba2_untied_dt_limit")
    convert("export", "--checkpoint", ckpt, "--tag", "step_000005", "--output", tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["Mamba2ForCausalLM"] and hf["model_type"] == "mamba2"
    # the real vocabulary (37 ids; our 3 padding rows are not written) and how to pad it back
    assert (hf["vocab_size"], hf["pad_vocab_size_multiple"]) == (37, 8)
    assert (hf["num_heads"], hf["head_dim"], hf["n_groups"], hf["state_size"]) == (6, 6, 2, 6)
    assert (hf["time_step_limit"], hf["chunk_size"], hf["tie_word_embeddings"]) == ([0.001, 0.5], 8, False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        rows = {f.get_slice(n).get_shape()[0] for n in ("backbone.embeddings.weight", "lm_head.weight")}
    assert "backbone.embeddings.weight" in keys and "backbone.embedding.weight" not in keys and "lm_head.weight" in keys
    assert rows == {37}


def test_export_and_import_carry_the_tokenizer(tmp_path):
    _, ckpt = checkpoint_of(tmp_path, "mamba1_tied", tokenizer=Bytes())
    convert("export", "--checkpoint", ckpt, "--output", tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["eos_token_id"] == hf["bos_token_id"] == Bytes.eod
    assert load_tokenizer(str(tmp_path / "hf")).eod == Bytes.eod
    convert("import", "--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ours")
    assert load_tokenizer(str(tmp_path / "ours")).eod == Bytes.eod


def test_import_mamba_ssm_reads_pytorch_model_bin_without_unpickling_code(tmp_path):
    config = tiny("Mamba2")
    model = perturbed_model(config, 1)
    (tmp_path / "ssm").mkdir()
    config.to_json(str(tmp_path / "ssm" / "config.json"))
    torch.save(model.state_dict(), tmp_path / "ssm" / "pytorch_model.bin")  # tied head included, as mamba_ssm saves
    convert("import", "--from", "mamba_ssm", "--input", tmp_path / "ssm", "--output", tmp_path / "ours")
    back = load_model_folder(str(tmp_path / "ours"))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_import_refuses_a_pickle_that_would_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ssm").mkdir()
    tiny("Mamba1").to_json(str(tmp_path / "ssm" / "config.json"))
    torch.save({"backbone.embedding.weight": Payload()}, tmp_path / "ssm" / "pytorch_model.bin")
    refused(
        ["import", "--from", "mamba_ssm", "--input", tmp_path / "ssm", "--output", tmp_path / "ours"],
        r"pytorch_model.bin: not loadable with weights_only=True",
    )
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "ours").exists()


def test_import_hf_reads_sharded_safetensors_and_special_floats(tmp_path):
    config = tiny("Mamba2")
    model = perturbed_model(config, 2)
    hf = hf_config(config, torch.float32)
    hf["time_step_limit"] = [0.0, {"__float__": "Infinity"}]  # how transformers 5 writes inf
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    state = {
        ("backbone.embeddings.weight" if k == "backbone.embedding.weight" else k): v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "hf" / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    convert("import", "--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ours")
    back = load_model_folder(str(tmp_path / "ours"))
    assert back.config.mixer_options.dt_limit == (0.0, float("inf"))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())  # padding rows held


@pytest.mark.parametrize(
    "layer,ssm,fields,named",
    [
        (
            "Mamba1",
            {},
            {"rms_norm": False},
            r"rms_norm=false \(LayerNorm\): transformers' Mamba and Mamba2 have RMSNorm",
        ),
        ("Mamba1", {"expand": 1.5}, {}, r"ssm_cfg.expand=1.5: transformers stores expand as an integer"),
        ("Mamba2", {"norm_before_gate": True}, {}, r"ssm_cfg.norm_before_gate=true: transformers' Mamba2 gates before"),
        ("Mamba2", {"D_has_hdim": True}, {}, r"ssm_cfg.D_has_hdim=true: transformers' Mamba2 has one D per head"),
        ("Mamba2", {"rmsnorm": False}, {}, r"ssm_cfg.rmsnorm=false: transformers' Mamba2 always applies the gated"),
    ],
)
def test_export_refuses_what_transformers_cannot_represent(tmp_path, layer, ssm, fields, named):
    config = tiny(layer, ssm=ssm, **fields)
    save_model_folder(perturbed_model(config, 0), str(tmp_path / "folder"))
    refused(["export", "--checkpoint", tmp_path / "folder", "--output", tmp_path / "hf"], named)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "change,named",
    [
        ({"model_type": "llama"}, r"model_type='llama': only \['mamba', 'mamba2'\]"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu': the Mamba mixers use silu only"),
        ({"layer_norm_epsilon": 1e-6}, r"layer_norm_epsilon=1e-06: our norms use mamba_ssm's 1e-05"),
        ({"num_heads": 5}, r"num_heads=5 x head_dim=6 != expand x hidden_size = 36"),
    ],
)
def test_import_refuses_what_we_cannot_represent(change, named):
    hf = {**hf_config(tiny("Mamba2"), torch.float32), **change}
    with pytest.raises(HFFormatError, match=named):
        config_from_hf(hf)


def test_output_that_exists_is_never_overwritten(tmp_path):
    _, ckpt = checkpoint_of(tmp_path, "mamba1_tied")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    before = snapshot(str(tmp_path))
    refused(
        ["export", "--checkpoint", ckpt, "--output", tmp_path / "hf"],
        r"--output .*hf: exists and is not an empty directory; choose another --output or pass --overwrite to replace",
    )
    assert snapshot(str(tmp_path)) == before


def test_export_of_a_missing_checkpoint_says_so(tmp_path):
    refused(
        ["export", "--checkpoint", tmp_path / "nowhere", "--output", tmp_path / "hf"],
        r"convert export: error: --checkpoint .*nowhere: no such directory",
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_transformers_logits_of_the_export_equal_ours(tmp_path, case, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model, ckpt = checkpoint_of(tmp_path, case, seed=7)
    convert("export", "--checkpoint", ckpt, "--output", tmp_path / "hf")
    cls = transformers.MambaForCausalLM if case.startswith("mamba1") else transformers.Mamba2ForCausalLM
    hf, info = cls.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():  # the export holds the real vocabulary's rows only
        ref = model.double()(ids)[..., : model.config.vocab_size]
        ours = model.float()(ids)[..., : model.config.vocab_size]
        theirs = hf.eval()(ids).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ref.shape
    err, our_err = relative_error(theirs, ref), relative_error(ours, ref)
    print(f"{case}: transformers vs float64 {err:.2e}, ours (float32) vs float64 {our_err:.2e}")
    assert err <= 1e-4, (case, err)


def test_export_of_a_tag_the_save_directory_lacks_names_the_tags_it_holds(tmp_path):
    _, ckpt = checkpoint_of(tmp_path, "mamba2_untied_dt_limit")
    refused(
        ["export", "--checkpoint", ckpt, "--tag", "step_000999", "--output", tmp_path / "hf"],
        rf"--tag step_000999: {ckpt} has no checkpoint step_000999 \(it holds step_000005\); name one of its tags",
    )
    assert not (tmp_path / "hf").exists()
