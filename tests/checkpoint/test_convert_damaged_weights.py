"""`convert export` and `convert import` refuse weights holding a NaN or an infinity: one line naming the first
such tensor, exit status 2, no --output (without the check, the NaN was copied on)."""

import os
import re

import torch

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from convert_cli import refused
from megamamba.checkpoint import model_tensors, save_checkpoint

DAMAGED = "backbone.layers.1.mixer.in_proj.weight"
DAMAGE = "holds 2 NaN / inf values (first at index (7, 3)); the weights are damaged: load another checkpoint"


def damaged_model():
    model = perturbed_model(tiny("Mamba2"), 0)
    with torch.no_grad():
        model.get_parameter(DAMAGED)[7, 3] = float("nan")
        model.get_parameter(DAMAGED)[9, 0] = float("-inf")
    return model


def test_export_of_a_checkpoint_holding_nan_is_refused_naming_the_tensor(tmp_path):
    model = damaged_model()
    save_checkpoint(str(tmp_path / "save"), 5, model.config, model_tensors(model))
    before = snapshot(str(tmp_path))
    line = f'convert export: error: {tmp_path}/save/step_000005: tensor "{DAMAGED}" {DAMAGE}'
    refused(["export", "--checkpoint", tmp_path / "save", "--output", tmp_path / "hf"], f"^{re.escape(line)}$")
    assert snapshot(str(tmp_path)) == before


def test_import_of_a_mamba_ssm_folder_holding_nan_is_refused_naming_the_tensor(tmp_path):
    model = damaged_model()
    os.mkdir(tmp_path / "ssm")
    model.config.to_json(str(tmp_path / "ssm" / "config.json"))
    torch.save(model.state_dict(), tmp_path / "ssm" / "pytorch_model.bin")
    before = snapshot(str(tmp_path))
    line = f'convert import: error: {tmp_path}/ssm: tensor "{DAMAGED}" {DAMAGE}'
    refused(
        ["import", "--from", "mamba_ssm", "--input", tmp_path / "ssm", "--output", tmp_path / "ours"],
        f"^{re.escape(line)}$",
    )
    assert snapshot(str(tmp_path)) == before
