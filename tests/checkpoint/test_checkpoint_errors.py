"""Bad input gives one clear CheckpointError (what is wrong, how to go on) and changes nothing on disk."""

import json
import os

import pytest

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from megamamba import MambaConfig
from megamamba.checkpoint import (
    Checkpoint,
    CheckpointError,
    NoCheckpointError,
    check_save_dir,
    config_differences,
    model_tensors,
    open_checkpoint,
    resolve_load,
    save_checkpoint,
)
from megamamba.checkpoint.files import read_json

CONFIG = tiny("Mamba1")


@pytest.fixture
def save_dir(tmp_path):
    """A save directory with the complete checkpoints step_000001 and step_000002 (latest)."""
    weights = model_tensors(perturbed_model(CONFIG, 0))
    for step in (1, 2):
        save_checkpoint(str(tmp_path), step, CONFIG, weights)
    return tmp_path


def unchanged_after(directory, action, error, match):
    before = snapshot(str(directory))
    with pytest.raises(error, match=match) as e:
        action()
    assert snapshot(str(directory)) == before
    assert "\n" not in str(e.value)
    return str(e.value)


def test_truncated_file_is_reported_with_its_sizes(save_dir):
    path = save_dir / "step_000002" / "optimizer.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    unchanged_after(
        save_dir,
        lambda: Checkpoint(str(save_dir / "step_000002")),
        CheckpointError,
        r"optimizer.safetensors: \d+ bytes, manifest.json says \d+: the file is truncated or corrupt; "
        "resume from another checkpoint",
    )


def test_corrupt_file_of_the_right_size_is_caught_by_its_checksum(save_dir):
    path = save_dir / "step_000002" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    unchanged_after(
        save_dir,
        lambda: resolve_load(str(save_dir)),
        CheckpointError,
        r"model.safetensors: sha256 differs from manifest.json: the file is corrupt.*--load auto",
    )


def test_missing_latest_names_the_file_and_the_ways_on(save_dir):
    os.remove(save_dir / "latest")
    message = unchanged_after(save_dir, lambda: open_checkpoint(str(save_dir)), CheckpointError, r"no 'latest' file")
    assert "step_000002, step_000001" in message and "--load auto" in message


def test_load_auto_without_any_checkpoint_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("no checkpoints here")
    unchanged_after(
        tmp_path,
        lambda: open_checkpoint("auto", str(tmp_path)),
        NoCheckpointError,
        r"no complete checkpoint under .*latest is missing; it holds no step_\* checkpoint",
    )


def test_load_auto_needs_a_save_directory():
    with pytest.raises(CheckpointError, match=r"--load auto: .* but --save is not set"):
        open_checkpoint("auto", None)


def test_model_config_that_differs_names_the_fields(save_dir):
    run = tiny("Mamba1", d_model=20, ssm={"dt_rank": 4})
    ckpt = open_checkpoint("auto", str(save_dir))
    unchanged_after(
        save_dir,
        lambda: ckpt.check_config(run),
        CheckpointError,
        r"model config differs from the run's: d_model: checkpoint 18, run 20; ssm_cfg.dt_rank: "
        r"checkpoint 3, run 4\. Resume with the checkpoint's config.json",
    )


def test_save_directory_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    unchanged_after(
        tmp_path,
        lambda: check_save_dir(str(tmp_path / "file" / "ckpt")),
        CheckpointError,
        r"--save .*file/ckpt: cannot create it \(Not a directory\); choose a directory you can write",
    )
    unchanged_after(
        tmp_path, lambda: check_save_dir(str(tmp_path / "file")), CheckpointError, r"--save .*file: not a directory"
    )


def test_read_only_save_directory_is_refused_before_training(tmp_path):
    if os.geteuid() == 0:  # root writes into any directory with mode bits; sysfs refuses new files even to root
        with pytest.raises(CheckpointError, match=r"--save /sys/kernel: not writable \(Permission denied\); fix"):
            check_save_dir("/sys/kernel")
        return
    os.chmod(tmp_path, 0o500)
    try:
        unchanged_after(
            tmp_path,
            lambda: check_save_dir(str(tmp_path)),
            CheckpointError,
            r"not writable \(Permission denied\); fix its permissions",
        )
    finally:
        os.chmod(tmp_path, 0o700)


def test_writable_save_directory_is_created_and_left_empty(tmp_path):
    check_save_dir(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path / "a" / "b") == []


def test_malformed_manifest_json_gives_line_and_column(save_dir):
    (save_dir / "step_000002" / "manifest.json").write_text('{"format": "megamamba-checkpoint",\n  "files": {,}}')
    unchanged_after(
        save_dir,
        lambda: Checkpoint(str(save_dir / "step_000002")),
        CheckpointError,
        r"checkpoint manifest .*manifest.json: malformed JSON at line 2 column 13",
    )


def test_malformed_latest_is_named(save_dir):
    (save_dir / "latest").write_text("../../etc\n")
    unchanged_after(
        save_dir,
        lambda: open_checkpoint(str(save_dir)),
        CheckpointError,
        r"latest: holds '../../etc', not a checkpoint tag like 'step_000123'",
    )


def test_malformed_json_config_file(tmp_path):
    (tmp_path / "model.json").write_text('{"d_model": 16,}')
    with pytest.raises(CheckpointError, match=r"model config .*model.json: malformed JSON at line 1 column 16"):
        read_json(str(tmp_path / "model.json"), "model config")


@pytest.mark.parametrize("entry", [{"sha256": "00"}, {"size": "12", "sha256": "00"}, {"size": 12}, None])
def test_a_malformed_manifest_entry_is_one_error_naming_the_file(save_dir, entry):
    path = save_dir / "step_000002" / "manifest.json"
    manifest = read_json(str(path))
    manifest["files"]["config.json"] = entry
    path.write_text(json.dumps(manifest))
    unchanged_after(
        save_dir,
        lambda: resolve_load(str(save_dir / "step_000002")),
        CheckpointError,
        r"manifest.json: the entry of 'config.json' is .*; each entry is \{\"size\"",
    )


def test_attention_options_differ_only_where_their_values_do():
    def hybrid(**attention):
        return MambaConfig(
            d_model=64, n_layer=2, attn_layer_idx=[1], attn_cfg={"num_heads": 4, "causal": True, **attention}
        )

    assert config_differences(hybrid(), hybrid(rotary_emb_dim=0)) == []  # a default written out is the default
    assert config_differences(hybrid(), hybrid(rotary_emb_dim=8)) == ["attn_cfg.rotary_emb_dim: checkpoint 0, run 8"]
