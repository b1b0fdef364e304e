"""`convert export --overwrite` replaces an earlier export, and only a model folder, and only once the new one is
complete. (Without the flag an existing folder is refused: test_convert.py.)"""

import os

import torch
from safetensors.torch import load_file

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from convert_cli import convert, refused
from megamamba.checkpoint import model_tensors, save_checkpoint


def checkpoint(tmp_path, seed: int) -> str:
    """A tiny Mamba-2 checkpoint whose weights depend on `seed`."""
    model = perturbed_model(tiny("Mamba2"), seed)
    path = str(tmp_path / f"ckpt{seed}")
    save_checkpoint(path, 5, model.config, model_tensors(model))
    return path


def test_export_replaces_an_earlier_export_under_overwrite(tmp_path):
    convert("export", "--checkpoint", checkpoint(tmp_path, 0), "--output", tmp_path / "hf")
    first = load_file(str(tmp_path / "hf" / "model.safetensors"))
    convert("export", "--checkpoint", checkpoint(tmp_path, 1), "--output", tmp_path / "hf", "--overwrite")
    second = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert not all(torch.equal(first[name], second[name]) for name in first)
    assert sorted(os.listdir(tmp_path)) == ["ckpt0", "ckpt1", "hf"]  # no staging folder left beside it


def test_overwrite_refuses_a_folder_that_is_not_a_model_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    ckpt = checkpoint(tmp_path, 0)
    before = snapshot(str(tmp_path))
    message = refused(
        ["export", "--checkpoint", ckpt, "--output", tmp_path / "mine", "--overwrite"],
        r"has no config\.json",
    )
    assert message == (
        f"convert export: error: --output {tmp_path}/mine: has no config.json, and --overwrite replaces only a "
        f"model folder; choose another --output, or remove {tmp_path}/mine yourself"
    )
    assert snapshot(str(tmp_path)) == before


def test_a_failed_export_under_overwrite_leaves_the_earlier_export_as_it_was(tmp_path):
    ckpt = checkpoint(tmp_path, 0)
    convert("export", "--checkpoint", ckpt, "--output", tmp_path / "hf")
    before = snapshot(str(tmp_path))
    refused(["export", "--checkpoint", ckpt, "--tag", "step_000999", "--output", tmp_path / "hf", "--overwrite"], "")
    assert snapshot(str(tmp_path)) == before
