"""A checkpoint written by several writers, each the pieces it holds (TP rows, ZeRO fragments), reads like a
one-file one everywhere: `Checkpoint`, a model folder (generation), HF export. Format versions 1 and 2 still read."""

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
    write_shard,
)
from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.convert import export_hf
from megamamba.checkpoint.folder_tensors import FolderTensors
from megamamba.checkpoint.manifest import write_manifest
from megamamba.checkpoint.model_folder import load_model_folder
from megamamba.checkpoint.tensor_pieces import Cut, Piece

CONFIG = tiny("Mamba2", tie_embeddings=False)
MOMENTS = (("exp_avg", 0.5), ("exp_avg_sq", 0.25))


def _rows(name: str, t: torch.Tensor, half: int) -> list:
    """The first (half 0) or second half of `t`'s rows as a held piece (TP-like); [] when it has none."""
    split = t.shape[0] // 2
    start, stop = (0, split) if half == 0 else (split, t.shape[0])
    if start == stop:
        return []
    return [(name, Piece(name, tuple(t.shape), Cut(0, ((start, stop),), (stop - start, *t.shape[1:]))), t[start:stop])]


def _fragment(name: str, t: torch.Tensor, part: int) -> list:
    """The first (part 0) or second third... of `t` flattened, as a held piece (ZeRO-like)."""
    split = t.numel() // 3
    start, stop = (0, split) if part == 0 else (split, t.numel())
    if start == stop:
        return []
    return [(name, Piece(name, tuple(t.shape), Cut.whole(t.shape), (start, stop)), t.reshape(-1)[start:stop])]


def writers() -> tuple:
    """(full model tensors, [(params, optimizer, groups) of writers 0..3]): layer 0 and the embedding split in
    rows between writers 0 and 1, the rest in flat fragments between writers 2 and 3, with stand-in Adam
    moments; the first writer of each pair adds `step` and its stage's optimizer groups."""
    model = perturbed_model(CONFIG, 3)
    full = model_tensors(model)
    (group,) = optimizer_groups(torch.optim.AdamW(model.parameters()), model)
    out = []
    for first, cut in ((True, _rows), (False, _fragment)):
        names = [n for n in full if ("layers.0." in n or "embedding" in n) == first]
        for part in (0, 1):
            params = [h for n in names for h in cut(n, full[n], part)]
            optimizer = [h for n in names for k, scale in MOMENTS for h in cut(f"{n}/{k}", full[n] * scale, part)]
            steps = [(f"{n}/step", None, torch.tensor(4.0)) for n in names] if part == 0 else []
            out.append((params, optimizer + steps, [{**group, "params": names}] if part == 0 else []))
    return full, out


def save_by_writers(save_dir: str, parts: list) -> str:
    staging = begin(save_dir, 4)
    records = {}
    for rank, part in enumerate(parts):
        records |= write_shard(staging, rank, *part)
        records |= write_rng(staging, rank, capture_rng())
    return finish(save_dir, staging, 4, CONFIG, records, extra={"note": "four writers"})


def test_writers_pieces_read_as_one_checkpoint_model_folder_and_hf_export(tmp_path):
    full, parts = writers()
    path = save_by_writers(str(tmp_path / "save"), parts)
    assert sorted(n for n in os.listdir(path) if n.startswith(("model", "optimizer"))) == [
        *[f"model-rank-0000{r}.safetensors" for r in range(4)],
        "model.safetensors.index.json",
        *[f"optimizer-rank-0000{r}.safetensors" for r in range(4)],
        "optimizer.safetensors.index.json",
    ]
    ckpt = Checkpoint(path)
    loaded = ckpt.model_tensors()
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[k], full[k]) for k in full)
    assert ckpt.model_tensors(["backbone.norm_f.weight"]).keys() == {"backbone.norm_f.weight"}
    moments = ckpt.optimizer_tensors(["backbone.layers.1.mixer.D"])
    assert torch.equal(moments["backbone.layers.1.mixer.D/exp_avg"], full["backbone.layers.1.mixer.D"] * 0.5)
    assert len(ckpt.optimizer_tensors()) == 3 * len(full)
    assert [sorted(g["params"]) for g in ckpt.optimizer_groups] == [sorted(full)]
    assert ckpt.rng_state(1, 4)["torch"].shape == capture_rng()["torch"].shape
    model = load_model_folder(path)
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in full)
    assert os.path.isfile(os.path.join(export_hf(path, str(tmp_path / "hf")), "model.safetensors"))


def test_a_cut_reads_only_the_pieces_it_overlaps(tmp_path, monkeypatch):
    full, parts = writers()
    path = save_by_writers(str(tmp_path / "save"), parts)
    name = "backbone.embedding.weight"
    opened = []
    handle = FolderTensors._handle
    monkeypatch.setattr(FolderTensors, "_handle", lambda self, file: opened.append(file) or handle(self, file))
    rows, width = full[name].shape
    (cut,) = Checkpoint(path).model_cuts({"mine": (name, Cut(0, ((0, rows // 2),), (rows // 2, width)))}).values()
    assert torch.equal(cut, full[name][: rows // 2])
    assert opened == ["model-rank-00000.safetensors"], "the index describes the pieces: only the one read is opened"


def test_a_cut_the_pieces_cannot_give_is_a_checkpoint_error_naming_the_tensor(tmp_path):
    full, parts = writers()
    path = save_by_writers(str(tmp_path / "save"), parts)
    name = "backbone.embedding.weight"
    rows, width = full[name].shape
    with pytest.raises(CheckpointError, match=rf"model: {name}: cannot cut {name}: local shape \(2, {width + 1}\)"):
        Checkpoint(path).model_cuts({"mine": (name, Cut(0, ((0, 2),), (2, width + 1)))})


def test_a_piece_written_by_two_writers_is_refused_and_nothing_is_committed(tmp_path):
    _, parts = writers()
    params, optimizer, groups = parts[1]
    parts[1] = (params + [h for h in parts[0][0] if h[0] == "backbone.embedding.weight"], optimizer, groups)
    with pytest.raises(CheckpointError, match=r"backbone.embedding.weight: the local tensor with rows .* is stored 2"):
        save_by_writers(str(tmp_path), parts)
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".tmp-")]


def test_a_missing_writer_is_refused(tmp_path):
    _, parts = writers()
    with pytest.raises(
        CheckpointError,
        match=r"backbone.embedding.weight: the pieces' rows \[\(0, \d+\)\] along "
        "dim 0 do not cover",
    ):
        save_by_writers(str(tmp_path), [parts[0], parts[2], parts[3]])


def test_a_save_missing_one_parameters_optimizer_state_is_refused(tmp_path):
    _, parts = writers()
    parts = [
        (params, [h for h in optimizer if h[0] != "backbone.embedding.weight/exp_avg"], groups)
        for params, optimizer, groups in parts
    ]
    with pytest.raises(CheckpointError, match=r"optimizer state missing \['backbone.embedding.weight/exp_avg'\]"):
        save_by_writers(str(tmp_path), parts)


def test_a_format_version_2_checkpoint_with_one_file_per_stage_reads(tmp_path):
    full, _ = writers()
    path = tmp_path / "step_000004"
    path.mkdir()
    stage = {
        n: "model-00001-of-00002.safetensors" if "layers.0." in n else "model-00002-of-00002.safetensors" for n in full
    }
    for file in sorted(set(stage.values())):
        files.write_tensors(str(path / file), {n: t for n, t in full.items() if stage[n] == file})
    files.write_json(str(path / "model.safetensors.index.json"), {"metadata": {}, "weight_map": stage})
    files.write_tensors(str(path / "optimizer.safetensors"), {f"{n}/exp_avg": t for n, t in full.items()})
    files.write_tensors(str(path / "rng-rank-00000.safetensors"), *rng_files.to_file([capture_rng()]))
    files.write_json(str(path / "config.json"), CONFIG.to_dict())
    files.write_json(
        str(path / "trainer_state.json"),
        {"format_version": 2, "step": 4, "scheduler": None, "optimizer": {"param_groups": []}, "extra": {}},
    )
    write_manifest(str(path), "step_000004", 4)
    ckpt = Checkpoint(str(path))
    assert all(torch.equal(ckpt.model_tensors()[k], full[k]) for k in full)
    assert torch.equal(
        ckpt.optimizer_tensors(["backbone.norm_f.weight"])["backbone.norm_f.weight/exp_avg"],
        full["backbone.norm_f.weight"],
    )


def test_a_format_version_1_checkpoint_reads(tmp_path):
    full, _ = writers()
    path = tmp_path / "step_000004"
    path.mkdir()
    states = [capture_rng(), capture_rng()]
    files.write_json(str(path / "config.json"), CONFIG.to_dict())
    files.write_tensors(str(path / "model.safetensors"), full)
    files.write_tensors(str(path / "optimizer.safetensors"), {f"{n}/exp_avg": t for n, t in full.items()})
    files.write_tensors(str(path / "rng.safetensors"), *rng_files.to_file(states))
    files.write_json(
        str(path / "trainer_state.json"),
        {"format_version": 1, "step": 4, "scheduler": None, "optimizer": {"param_groups": []}, "extra": {}},
    )
    write_manifest(str(path), "step_000004", 4)
    ckpt = Checkpoint(str(path))
    assert all(torch.equal(ckpt.model_tensors()[k], full[k]) for k in full)
    assert len(ckpt.optimizer_tensors(["backbone.norm_f.weight"])) == 1
    assert torch.equal(ckpt.rng_state(1, 2)["torch"], states[1]["torch"])
    text = (path / "trainer_state.json").read_text()
    (path / "trainer_state.json").write_text(text.replace('"format_version": 1', '"format_version": 4'))
    with pytest.raises(CheckpointError, match=r"format version 4, this code reads \(1, 2, 3\)"):
        Checkpoint(str(path), hashes=False)
