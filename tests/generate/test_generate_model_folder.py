"""Model folders (config.json + model.safetensors + tokenizer) load without unpickling; the CLI generates from one."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamamba import MambaConfig, MambaLM
from megamamba.checkpoint import model_tensors, save_checkpoint
from megamamba.checkpoint.convert import main as convert_main
from megamamba.checkpoint.model_folder import ModelFolderError, load_model_folder, save_model_folder
from megamamba.generate import main as generate_main
from megamamba.tokenizer import load_tokenizer

SSM = {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8}


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=18, n_layer=2, vocab_size=257, ssm_cfg=SSM))
    save_model_folder(model, str(tmp_path / "m"), tokenizer=load_tokenizer("bytes"))
    return model, str(tmp_path / "m")


def test_saved_folder_loads_the_same_model(folder):
    model, path = folder
    loaded = load_model_folder(path)
    ids = torch.randint(0, 257, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight, "the tied head is no longer tied"
    assert "lm_head.weight" not in load_file(path + "/model.safetensors")


def test_an_explicit_tied_head_equal_to_the_embedding_loads(folder):
    model, path = folder
    state = load_file(path + "/model.safetensors")
    state["lm_head.weight"] = state["backbone.embedding.weight"].clone()
    save_file(state, path + "/model.safetensors")
    assert torch.equal(load_model_folder(path).lm_head.weight, model.lm_head.weight)


def test_folder_loads_in_another_dtype(folder):
    _, path = folder
    assert load_model_folder(path, dtype=torch.bfloat16).backbone.embedding.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda p: open(p + "/model.safetensors", "wb").write(b"\x00" * 20),
            "model.safetensors: not a readable safetensors",
        ),
        (lambda p: __import__("os").remove(p + "/model.safetensors"), "model.safetensors: no such file"),
        (lambda p: __import__("os").remove(p + "/config.json"), "config.json: no such file"),
        (
            lambda p: save_file(
                {k: v for k, v in load_file(p + "/model.safetensors").items() if "norm_f" not in k},
                p + "/model.safetensors",
            ),
            r"missing \['backbone.norm_f.weight'\]",
        ),
        (
            lambda p: json.dump({**json.load(open(p + "/config.json")), "d_model": 12}, open(p + "/config.json", "w")),
            r"backbone.embedding.weight has shape \(264, 18\), the config implies \(264, 12\)",
        ),
    ],
)
def test_broken_folders_fail_clearly(folder, damage, message):
    _, path = folder
    damage(path)
    with pytest.raises(ModelFolderError, match=message):
        load_model_folder(path)


def test_command_line_prints_prompt_and_continuation(folder, capsys):
    _, path = folder
    generate_main(["--checkpoint", path, "--prompt", "Hi", "--max-new-tokens", "5", "--greedy", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("Hi") and len(out.rstrip("\n")) >= 2


def test_command_line_generates_from_a_hybrid_folder(tmp_path, capsys):
    torch.manual_seed(0)
    config = MambaConfig(
        d_model=18,
        n_layer=3,
        vocab_size=257,
        ssm_cfg=SSM,
        hybrid_layer_pattern="M*-",
        d_intermediate=20,
        attn_cfg={"num_heads": 3, "num_heads_kv": 1, "causal": True},
    )
    save_model_folder(MambaLM(config), str(tmp_path / "m"), tokenizer=load_tokenizer("bytes"))
    generate_main(
        ["--checkpoint", str(tmp_path / "m"), "--prompt", "Hi", "--max-new-tokens", "5", "--greedy", "--device", "cpu"]
    )
    assert capsys.readouterr().out.startswith("Hi")


def refused(capsys, argv, match: str) -> str:
    """The one stderr line (after any note) of a refusal with exit status 2."""
    with pytest.raises(SystemExit) as e:
        generate_main(argv)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("generate: note:")]
    assert len(lines) == 1 and lines[0].startswith("generate: error: ") and re.search(match, lines[0]), lines
    return lines[0]


def test_command_line_without_a_tokenizer_says_what_to_pass(folder, tmp_path, capsys):
    _, path = folder
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    refused(
        capsys, ["--checkpoint", path, "--prompt", "x", "--device", "cpu"], "holds no tokenizer files; pass --tokenizer"
    )


def test_command_line_refuses_a_tokenizer_larger_than_the_model(tmp_path, capsys):
    model = MambaLM(MambaConfig(d_model=18, n_layer=1, vocab_size=100, ssm_cfg=SSM))
    save_model_folder(model, str(tmp_path / "m"))
    message = r"generate: error: tokenizer Bytes\(\) has 257 ids but the model config's vocab_size is 100"
    refused(capsys, ["--checkpoint", str(tmp_path / "m"), "--tokenizer", "bytes", "--device", "cpu"], message)


def test_command_line_follows_a_save_directorys_latest_checkpoint(folder, tmp_path, capsys):
    model, path = folder
    generate_main(["--checkpoint", path, "--prompt", "Hi", "--max-new-tokens", "6", "--greedy", "--device", "cpu"])
    from_folder = capsys.readouterr().out
    save_checkpoint(str(tmp_path / "save"), 7, model.config, model_tensors(model), tokenizer=load_tokenizer("bytes"))
    generate_main(
        [
            "--checkpoint",
            str(tmp_path / "save"),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "6",
            "--greedy",
            "--device",
            "cpu",
        ]
    )
    assert capsys.readouterr().out == from_folder


def test_command_line_on_a_folder_that_is_neither_says_what_it_needs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    refused(
        capsys,
        ["--checkpoint", str(tmp_path / "empty"), "--prompt", "x", "--device", "cpu"],
        "--checkpoint .*empty: no 'latest' file",
    )


def test_command_line_on_a_transformers_export_says_to_import_it_first(folder, tmp_path, capsys):
    _, path = folder
    convert_main(["export", "--checkpoint", path, "--output", str(tmp_path / "hf")])
    capsys.readouterr()
    refused(
        capsys,
        ["--checkpoint", str(tmp_path / "hf"), "--prompt", "x", "--device", "cpu"],
        r"a transformers config \(model_type 'mamba2'\), not ours: import its folder first, python -m "
        r"megamamba.checkpoint.convert import --from hf --input FOLDER --output OUR_FOLDER",
    )
