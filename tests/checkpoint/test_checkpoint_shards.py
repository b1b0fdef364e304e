"""A checkpoint written by several stage writers (one shard per stage) reads like a one-file one, everywhere:
`Checkpoint`, a model folder (generation), HF export. A format-version-1 checkpoint still reads."""
import os

import pytest
import torch

from checkpoint_fixtures import perturbed_model, tiny
from megamamba.checkpoint import (
    Checkpoint,
    CheckpointError,
    begin,
    capture_rng,
    files,
    finish,
    model_tensors,
    optimizer_groups,
    write_rng,
    write_stage,
)
from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.manifest import write_manifest
from megamamba.convert import export_hf
from megamamba.model_folder import load_model_folder

CONFIG = tiny("Mamba2", tie_embeddings=False)


def stages() -> tuple:
    """(full model tensors, [(params, optimizer, groups) of stage 0 and stage 1]): layer 0 and the embedding
    in stage 0, the rest in stage 1, with stand-in Adam moments."""
    model = perturbed_model(CONFIG, 3)
    full = model_tensors(model)
    (group,) = optimizer_groups(torch.optim.AdamW(model.parameters()), model)
    split = []
    for first in (True, False):
        names = [n for n in full if ("layers.0." in n or "embedding" in n) == first]
        optimizer = {f"{n}/{k}": full[n] * s for n in names for k, s in (("exp_avg", 0.5), ("exp_avg_sq", 0.25))}
        split.append(({n: full[n] for n in names}, optimizer, [{**group, "params": names}]))
    return full, split


def save_in_stages(save_dir: str, split: list) -> str:
    staging = begin(save_dir, 4)
    records = {}
    for index, (params, optimizer, groups) in enumerate(split):
        records |= write_stage(staging, index, len(split), params, optimizer, groups)
        records |= write_rng(staging, index, capture_rng())
    return finish(save_dir, staging, 4, CONFIG, records, extra={"note": "two stages"})


def test_stage_shards_read_as_one_checkpoint_model_folder_and_hf_export(tmp_path):
    full, split = stages()
    path = save_in_stages(str(tmp_path / "save"), split)
    assert sorted(n for n in os.listdir(path) if n.startswith(("model", "optimizer"))) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors",
        "optimizer.safetensors.index.json"]
    ckpt = Checkpoint(path)
    loaded = ckpt.model_tensors()
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[k], full[k]) for k in full)
    assert ckpt.model_tensors(["backbone.norm_f.weight"]).keys() == {"backbone.norm_f.weight"}
    moments = ckpt.optimizer_tensors(["backbone.layers.1.mixer.D"])
    assert torch.equal(moments["backbone.layers.1.mixer.D/exp_avg"], full["backbone.layers.1.mixer.D"] * 0.5)
    assert len(ckpt.optimizer_tensors()) == 2 * len(full)
    assert [sorted(g["params"]) for g in ckpt.optimizer_groups] == [sorted(full)]
    assert ckpt.rng_state(1, 2)["torch"].shape == capture_rng()["torch"].shape
    model = load_model_folder(path)
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in full)
    assert os.path.isfile(os.path.join(export_hf(path, str(tmp_path / "hf")), "model.safetensors"))


def test_a_tensor_written_by_two_stages_is_refused_and_nothing_is_committed(tmp_path):
    _, split = stages()
    params, optimizer, groups = split[1]
    split[1] = ({**params, "backbone.embedding.weight": split[0][0]["backbone.embedding.weight"]}, optimizer, groups)
    with pytest.raises(CheckpointError, match=r"\['backbone.embedding.weight'\] written by two stages"):
        save_in_stages(str(tmp_path), split)
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".tmp-")]


def test_a_stage_missing_from_the_shards_is_refused(tmp_path):
    _, split = stages()
    with pytest.raises(CheckpointError, match=r"model shards missing \['model-00002-of-00002.safetensors'\]"):
        staging = begin(str(tmp_path), 4)
        records = write_stage(staging, 0, 2, *split[0])
        finish(str(tmp_path), staging, 4, CONFIG, records)


def test_a_format_version_1_checkpoint_reads(tmp_path):
    full, _ = stages()
    path = tmp_path / "step_000004"
    path.mkdir()
    states = [capture_rng(), capture_rng()]
    files.write_json(str(path / "config.json"), CONFIG.to_dict())
    files.write_tensors(str(path / "model.safetensors"), full)
    files.write_tensors(str(path / "optimizer.safetensors"), {f"{n}/exp_avg": t for n, t in full.items()})
    files.write_tensors(str(path / "rng.safetensors"), *rng_files.to_file(states))
    files.write_json(str(path / "trainer_state.json"), {"format_version": 1, "step": 4, "scheduler": None,
                                                       "optimizer": {"param_groups": []}, "extra": {}})
    write_manifest(str(path), "step_000004", 4)
    ckpt = Checkpoint(str(path))
    assert all(torch.equal(ckpt.model_tensors()[k], full[k]) for k in full)
    assert len(ckpt.optimizer_tensors(["backbone.norm_f.weight"])) == 1
    assert torch.equal(ckpt.rng_state(1, 2)["torch"], states[1]["torch"])
    text = (path / "trainer_state.json").read_text()
    (path / "trainer_state.json").write_text(text.replace('"format_version": 1', '"format_version": 3'))
    with pytest.raises(CheckpointError, match=r"format version 3, this code reads \(1, 2\)"):
        Checkpoint(str(path), hashes=False)
