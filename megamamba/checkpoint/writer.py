"""Writing a checkpoint (the format: checkpoint.py), in steps that several processes share.

    staging = begin(save_dir, step, keep_last)                         # the committing process
    records = write_stage(staging, stage, stages, model, optimizer, groups)   # one writer per stage
    records |= write_rng(staging, rank, capture_rng())                 # every rank
    path = finish(save_dir, staging, step, config, all_records, ...)   # the committing process

Each writer hands back only records {file: {"size", "sha256"}}, a few hundred bytes whatever the
model's size: the committing process takes names, shapes and optimizer groups from the shards'
safetensors headers, writes the shard indexes, config and trainer state, and commits with the
writers' hashes in the manifest (it reads no tensor data). Every disk change goes through `files`.
"""
import json
import os
import re
import struct
from typing import Mapping, Optional

import torch

from megamamba.checkpoint import files
from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.checkpoint import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    STATE_FILE,
    check_model_shapes,
    check_model_tensors,
    rng_file,
)
from megamamba.checkpoint.files import CheckpointError
from megamamba.checkpoint.manifest import sha256_of
from megamamba.checkpoint.store import check_keep_last, commit, stage, tag_for
from megamamba.config import MambaConfig
from megamamba.model_folder import index_file, shard_file

GROUPS_KEY = "param_groups"  # safetensors metadata of an optimizer shard: its stage's groups as JSON


def begin(save_dir: str, step: int, keep_last: Optional[int] = None) -> str:
    """A new staging directory for the checkpoint of `step` under `save_dir`."""
    check_keep_last(keep_last)
    os.makedirs(save_dir, exist_ok=True)
    return stage(save_dir, tag_for(step))


def _record(staging: str, file: str) -> dict:
    path = os.path.join(staging, file)
    return {file: {"size": os.path.getsize(path), "sha256": sha256_of(path)}}


def _check_visible(staging: str) -> None:
    if not os.path.isdir(staging):
        raise CheckpointError(f"{staging}: the staging directory of this save is not visible from this process; "
                              "--save must be a directory that every node shares")


def write_stage(staging: str, index: int, stages: int, model: Mapping[str, torch.Tensor],
                optimizer: Mapping[str, torch.Tensor], groups: list) -> dict:
    """Write stage `index` of `stages`: its full parameters and optimizer state by mamba_ssm name and its
    optimizer groups (`state.optimizer_groups`, in the optimizer shard's metadata); their records."""
    _check_visible(staging)
    records = {}
    for stem, tensors, metadata in ((MODEL, model, {"format": "pt"}),
                                    (OPTIMIZER, optimizer, {GROUPS_KEY: json.dumps(groups)})):
        file = f"{stem}.safetensors" if stages == 1 else shard_file(stem, index, stages)
        files.write_tensors(os.path.join(staging, file), dict(tensors), metadata=metadata)
        records.update(_record(staging, file))
    return records


def write_rng(staging: str, rank: int, state: dict) -> dict:
    """Write rank `rank`'s RNG states (`rng.capture_rng()`); its record."""
    _check_visible(staging)
    tensors, metadata = rng_files.to_file([state])
    files.write_tensors(os.path.join(staging, rng_file(rank)), tensors, metadata=metadata)
    return _record(staging, rng_file(rank))


def _header(path: str) -> tuple:
    """({name: (shape, bytes)}, metadata) of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    return {n: (tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0]) for n, e in header.items()}, metadata


def _shards(stem: str, names) -> list:
    """The files of the tensor set `stem` among `names`: `stem`.safetensors alone, or shards 1..N of N."""
    single = f"{stem}.safetensors"
    found = sorted(n for n in names if re.fullmatch(rf"{stem}-\d{{5}}-of-\d{{5}}\.safetensors", n))
    if not found:
        if single not in names:
            raise CheckpointError(f"save: no writer reported {single} or shards of it")
        return [single]
    count = max(int(n[-17:-12]) for n in found)  # "...-of-NNNNN.safetensors"
    expected = [shard_file(stem, i, count) for i in range(count)]
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected or single in names:
        unexpected += [single] if single in names else []
        raise CheckpointError(f"save: {stem} shards missing {missing}, unexpected {unexpected} (every stage's writer "
                              "must report its shard)")
    return expected


def _index(staging: str, stem: str, shards: list) -> tuple:
    """(weight map, shapes, metadata per shard) of the tensor set `stem`, written as its index when sharded."""
    weight_map, shapes, metadata, total = {}, {}, [], 0
    for file in shards:
        tensors, meta = _header(os.path.join(staging, file))
        twice = sorted(set(tensors) & set(weight_map))
        if twice:
            raise CheckpointError(f"save: {twice[:5]} written by two stages ({weight_map[twice[0]]} and {file})")
        weight_map.update(dict.fromkeys(tensors, file))
        shapes.update({n: shape for n, (shape, _) in tensors.items()})
        total += sum(size for _, size in tensors.values())
        metadata.append(meta)
    if len(shards) > 1:
        files.write_json(os.path.join(staging, index_file(stem)),
                         {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return weight_map, shapes, metadata


def merge_groups(stage_groups: list) -> list:
    """One list of optimizer groups from every stage's: hyperparameters of the first, member names united."""
    merged = [dict(g, params=list(g["params"])) for g in stage_groups[0]]
    for groups in stage_groups[1:]:
        if len(groups) != len(merged):
            raise CheckpointError(f"pipeline stages have {len(merged)} and {len(groups)} optimizer groups")
        for m, g in zip(merged, groups):
            m["params"] += [n for n in g["params"] if n not in m["params"]]
    return merged


def finish(save_dir: str, staging: str, step: int, config: MambaConfig, records: dict, *,
           scheduler: Optional[dict] = None, extra: Optional[dict] = None, tokenizer=None,
           keep_last: Optional[int] = None, protect: Optional[str] = None) -> str:
    """Complete the staged checkpoint from every writer's `records` and commit it; returns its path.

    scheduler: `state.scheduler_state`. extra: JSON the trainer wants back (args, layout, data
    position). tokenizer: anything with `save(directory)`. keep_last: checkpoints to keep (None: all);
    protect: the tag of a checkpoint that retention must keep whatever keep_last says.
    """
    _, shapes, _ = _index(staging, MODEL, _shards(MODEL, records))
    check_model_shapes(shapes, config, f"save of step {step}")
    _, _, metadata = _index(staging, OPTIMIZER, _shards(OPTIMIZER, records))
    groups = merge_groups([json.loads(m.get(GROUPS_KEY, "[]")) for m in metadata])
    state = {"format_version": FORMAT_VERSION, "step": step, "optimizer": {"param_groups": groups},
             "scheduler": scheduler, "extra": extra or {}}
    try:
        state = json.loads(json.dumps(state))
    except TypeError as e:
        raise CheckpointError(f"save of step {step}: trainer state is not JSON ({e})") from None
    files.write_json(os.path.join(staging, CONFIG_FILE), config.to_dict())
    files.write_json(os.path.join(staging, STATE_FILE), state)
    if tokenizer is not None:
        tokenizer.save(staging)
    return commit(save_dir, staging, tag_for(step), step, keep_last, known=records, protect=protect)


def save_checkpoint(save_dir: str, step: int, config: MambaConfig, model: Mapping[str, torch.Tensor], *,
                    optimizer: Optional[Mapping[str, torch.Tensor]] = None, optimizer_groups: Optional[list] = None,
                    scheduler: Optional[dict] = None, rng: Optional[list] = None, extra: Optional[dict] = None,
                    tokenizer=None, keep_last: Optional[int] = None, protect: Optional[str] = None) -> str:
    """Write the checkpoint of `step` under `save_dir` atomically from one process; returns its path.

    model: full tensors by mamba_ssm name (`state.model_tensors`). optimizer / optimizer_groups:
    `state.optimizer_tensors` / `state.optimizer_groups`. rng: every rank's `rng.capture_rng()` in
    global rank order (default: this process's). The rest as `finish`.
    """
    model = check_model_tensors(model, config, "save_checkpoint")
    staging = begin(save_dir, step, keep_last)
    records = write_stage(staging, 0, 1, model, optimizer or {}, optimizer_groups or [])
    for rank, state in enumerate(rng if rng is not None else [rng_files.capture_rng()]):
        records.update(write_rng(staging, rank, state))
    return finish(save_dir, staging, step, config, records, scheduler=scheduler, extra=extra, tokenizer=tokenizer,
                  keep_last=keep_last, protect=protect)
