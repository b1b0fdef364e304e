"""Generation verifies what it loads: a checkpoint's sizes and checksums whatever path names it, a
plain model folder loaded with a note; refusals (a flipped bit, a missing CUDA) are one line, exit 2."""

import re

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.checkpoint import model_tensors, save_checkpoint
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.generate import main as generate_main
from megamamba.tokenizer import load_tokenizer

SSM = {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8}
PROMPT = ["--prompt", "Hi", "--max-new-tokens", "3", "--greedy", "--device", "cpu"]


@pytest.fixture
def save_dir(tmp_path):
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=18, n_layer=2, vocab_size=257, ssm_cfg=SSM))
    save_checkpoint(str(tmp_path / "save"), 3, model.config, model_tensors(model), tokenizer=load_tokenizer("bytes"))
    return tmp_path / "save"


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01  # a weight's byte: same size, different hash
    path.write_bytes(bytes(data))


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        generate_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("generate: error: "), err
    return err.strip()


@pytest.mark.parametrize("form", ["{save}/step_000003", "{save}/step_000003/", "{save}", "{save}/../save/step_000003"])
def test_a_flipped_bit_is_refused_whatever_path_names_the_checkpoint(save_dir, capsys, form):
    flip_a_bit(save_dir / "step_000003" / "model.safetensors")
    line = refusal(capsys, ["--checkpoint", form.format(save=save_dir), *PROMPT])
    assert re.search(r"model.safetensors: sha256 differs from manifest.json", line), line


def test_a_verified_checkpoint_generates_without_a_note(save_dir, capsys):
    generate_main(["--checkpoint", str(save_dir / "step_000003"), *PROMPT])
    out, err = capsys.readouterr()
    assert out.startswith("Hi") and err == ""


def test_a_model_folder_without_a_manifest_loads_and_says_so(tmp_path, capsys):
    model = MambaLM(MambaConfig(d_model=18, n_layer=2, vocab_size=257, ssm_cfg=SSM))
    save_model_folder(model, str(tmp_path / "m"), tokenizer=load_tokenizer("bytes"))
    generate_main(["--checkpoint", str(tmp_path / "m"), *PROMPT])
    out, err = capsys.readouterr()
    assert out.startswith("Hi")
    assert (
        err == f"generate: note: {tmp_path / 'm'} has no manifest.json: loading it as a plain model folder, "
        "without checksums\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_cuda_is_one_line(save_dir, capsys, device):
    line = refusal(capsys, ["--checkpoint", str(save_dir), "--device", device])
    assert f"--device {device}: CUDA is not available on this machine" in line and "use --device cpu" in line


def test_a_malformed_device_is_one_line(save_dir, capsys):
    assert "--device gpu0: " in refusal(capsys, ["--checkpoint", str(save_dir), "--device", "gpu0"])
