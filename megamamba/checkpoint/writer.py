"""Writing a checkpoint (the format: checkpoint.py), in steps that several processes share.

    staging = begin(save_dir, step, keep_last)                         # the committing process
    records = write_shard(staging, rank, model, optimizer, groups)     # every rank holding a distinct shard
    records |= write_rng(staging, rank, capture_rng())                 # every rank
    path = finish(save_dir, staging, step, config, all_records, ...)   # the committing process

Writers hand back only file sizes and hashes; the committing process checks from the headers that
every element is stored once. Memory and checks: docs/checkpoints.md.
"""

import json
import os
import re
import struct
from typing import Mapping, Optional, Sequence

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
from megamamba.checkpoint.folder_tensors import PIECES_KEY, FolderTensors, ModelFolderError, index_file, index_record
from megamamba.checkpoint.manifest import sha256_of
from megamamba.checkpoint.space import checkpoint_size, save_failed
from megamamba.checkpoint.store import check_keep_last, commit, discard, read_latest, stage, tag_for
from megamamba.checkpoint.tensor_pieces import Piece
from megamamba.config import MambaConfig

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
        raise CheckpointError(
            f"{staging}: the staging directory of this save is not visible from this process; "
            "--save must be a directory that every node shares"
        )


Held = tuple[str, Optional[Piece], torch.Tensor]
"""(full tensor name, where the tensor sits in it: None when it is the whole tensor, the tensor)."""


def whole(tensors: Mapping[str, torch.Tensor]) -> list:
    """Whole tensors by name as `Held` entries."""
    return [(name, None, t) for name, t in tensors.items()]


def set_file(stem: str, writer: Optional[int]) -> str:
    """The file of the tensor set `stem` a writer writes: `stem`.safetensors for the only writer (None)."""
    return f"{stem}.safetensors" if writer is None else f"{stem}-rank-{writer:05d}.safetensors"


def write_shard(
    staging: str, writer: Optional[int], model: Sequence[Held], optimizer: Sequence[Held], groups: list
) -> dict:
    """Write one writer's parameters and optimizer state (`Held` entries under mamba_ssm names; optimizer
    state "<name>/<key>") and its optimizer groups (`state.optimizer_groups`, [] when another writer
    gives them); their records. writer: this writer's number (its global rank), None for the only one.
    A writer with nothing of a set writes no file of it."""
    _check_visible(staging)
    records = {}
    for stem, held, metadata in (
        (MODEL, model, {"format": "pt"}),
        (OPTIMIZER, optimizer, {GROUPS_KEY: json.dumps(groups)} if groups else {}),
    ):
        if writer is not None and not held and not metadata.get(GROUPS_KEY):
            continue
        tensors, pieces = {}, {}
        for name, piece, tensor in held:
            key = name
            if piece is not None:
                key = f"{name}@{writer or 0}.{sum(r['name'] == name for r in pieces.values())}"
                pieces[key] = piece.record()
            if key in tensors:
                raise CheckpointError(f"save: writer {writer} holds {name} twice")
            tensors[key] = tensor
        if pieces:
            metadata = {**metadata, PIECES_KEY: json.dumps(pieces)}
        file = set_file(stem, writer)
        files.write_tensors(os.path.join(staging, file), tensors, metadata=metadata)
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


def _set_files(stem: str, names) -> list:
    """The files of the tensor set `stem` among the reported `names`: `stem`.safetensors alone, or writers' files."""
    single = f"{stem}.safetensors"
    found = sorted(n for n in names if re.fullmatch(rf"{stem}-rank-\d{{5}}\.safetensors", n))
    if single in names and found:
        raise CheckpointError(f"save: both {single} and {found[0]} were reported; one writer, or writers by rank")
    return found or ([single] if single in names else [])


def _index(staging: str, stem: str, set_files: list) -> list:
    """Write the index of the tensor set `stem` when there are writers' files, with every stored tensor's record
    (readers then open only the files they read from); the metadata of each file."""
    weight_map, records, metadata, total = {}, {}, [], 0
    for file in set_files:
        tensors, meta = _header(os.path.join(staging, file))
        twice = sorted(set(tensors) & set(weight_map))
        if twice:
            raise CheckpointError(f"save: {twice[:5]} written by two writers ({weight_map[twice[0]]} and {file})")
        pieces = json.loads(meta.get(PIECES_KEY, "{}"))
        for key, (shape, size) in tensors.items():
            record = index_record(key, shape, pieces.get(key))
            try:
                stored = Piece.from_record(record, f"save: {file}").stored_shape if "dim" in record else shape
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            if stored != shape:
                raise CheckpointError(f"save: {file}: {key} has shape {shape}, its record says {stored}")
            weight_map[key], records[key] = file, record
            total += size
        metadata.append(meta)
    if set_files and set_files != [f"{stem}.safetensors"]:
        files.write_json(
            os.path.join(staging, index_file(stem)),
            {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
                PIECES_KEY: dict(sorted(records.items())),
            },
        )
    return metadata


def _shapes(staging: str, stem: str) -> dict:
    """name -> full shape of every tensor of the set `stem`, checked to be stored whole or in pieces that hold
    each element once."""
    try:
        with FolderTensors(staging, stem, check=True) as tensors:
            return {name: tensors.shape(name) for name in tensors.names()}
    except ModelFolderError as e:
        raise CheckpointError(f"save: {e}") from None


def _check_state_complete(state: set, parameters: set, step: int) -> None:
    """CheckpointError unless every parameter the optimizer holds (`parameters`: its groups' members; frozen ones
    are not) has the same optimizer state keys ("<name>/<key>"), or none any."""
    keys = {name.rpartition("/")[2] for name in state}
    missing = sorted(f"{n}/{k}" for n in parameters for k in keys if f"{n}/{k}" not in state)
    unexpected = sorted(name for name in state if name.rpartition("/")[0] not in parameters)
    if missing or unexpected:
        raise CheckpointError(
            f"save of step {step}: optimizer state missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (every parameter needs state under every key, e.g. after its "
            "first optimizer step)"
        )


def merge_groups(stage_groups: list) -> list:
    """One list of optimizer groups from every stage's: hyperparameters of the first, member names united."""
    if not stage_groups:
        return []
    merged = [dict(g, params=list(g["params"])) for g in stage_groups[0]]
    for groups in stage_groups[1:]:
        if len(groups) != len(merged):
            raise CheckpointError(f"pipeline stages have {len(merged)} and {len(groups)} optimizer groups")
        for m, g in zip(merged, groups):
            m["params"] += [n for n in g["params"] if n not in m["params"]]
    return merged


def finish(
    save_dir: str,
    staging: str,
    step: int,
    config: MambaConfig,
    records: dict,
    *,
    scheduler: Optional[dict] = None,
    extra: Optional[dict] = None,
    tokenizer=None,
    keep_last: Optional[int] = None,
    protect: Optional[str] = None,
) -> str:
    """Complete the staged checkpoint from every writer's `records` and commit it; returns its path.

    scheduler: `state.scheduler_state`. extra: JSON the trainer wants back (args, layout, data
    position). tokenizer: anything with `save(directory)`. keep_last: checkpoints to keep (None: all);
    protect: the tag of a checkpoint that retention must keep whatever keep_last says.
    """
    model_files, optimizer_files = _set_files(MODEL, records), _set_files(OPTIMIZER, records)
    if not model_files:
        raise CheckpointError(f"save: no writer reported {MODEL}.safetensors or writers' files of it")
    _index(staging, MODEL, model_files)
    model_shapes = _shapes(staging, MODEL)
    check_model_shapes(model_shapes, config, f"save of step {step}")
    metadata = _index(staging, OPTIMIZER, optimizer_files)
    groups = merge_groups([json.loads(m[GROUPS_KEY]) for m in metadata if GROUPS_KEY in m])
    if optimizer_files:
        optimized = {name for group in groups for name in group["params"]} or set(model_shapes)
        _check_state_complete(set(_shapes(staging, OPTIMIZER)), optimized, step)
    state = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "optimizer": {"param_groups": groups},
        "scheduler": scheduler,
        "extra": extra or {},
    }
    try:
        state = json.loads(json.dumps(state))
    except TypeError as e:
        raise CheckpointError(f"save of step {step}: trainer state is not JSON ({e})") from None
    files.write_json(os.path.join(staging, CONFIG_FILE), config.to_dict())
    files.write_json(os.path.join(staging, STATE_FILE), state)
    if tokenizer is not None:
        tokenizer.save(staging)
    return commit(save_dir, staging, tag_for(step), step, keep_last, known=records, protect=protect)


def save_checkpoint(
    save_dir: str,
    step: int,
    config: MambaConfig,
    model: Mapping[str, torch.Tensor],
    *,
    optimizer: Optional[Mapping[str, torch.Tensor]] = None,
    optimizer_groups: Optional[list] = None,
    scheduler: Optional[dict] = None,
    rng: Optional[list] = None,
    extra: Optional[dict] = None,
    tokenizer=None,
    keep_last: Optional[int] = None,
    protect: Optional[str] = None,
) -> str:
    """Write the checkpoint of `step` under `save_dir` atomically from one process; returns its path.

    model: full tensors by mamba_ssm name (`state.model_tensors`). optimizer / optimizer_groups:
    `state.optimizer_tensors` / `state.optimizer_groups`. rng: every rank's `rng.capture_rng()` in
    global rank order (default: this process's). The rest as `finish`. A save that fails (a full disk, say)
    removes what it staged and leaves `latest` as it was: CheckpointError saying so and the bytes it needs.
    """
    model = check_model_tensors(model, config, "save_checkpoint")
    states = rng if rng is not None else [rng_files.capture_rng()]
    try:
        staging = begin(save_dir, step, keep_last)
        records = write_shard(staging, None, whole(model), whole(optimizer or {}), optimizer_groups or [])
        for rank, state in enumerate(states):
            records.update(write_rng(staging, rank, state))
        return finish(
            save_dir,
            staging,
            step,
            config,
            records,
            scheduler=scheduler,
            extra=extra,
            tokenizer=tokenizer,
            keep_last=keep_last,
            protect=protect,
        )
    except (OSError, CheckpointError) as e:
        discard(save_dir, tag_for(step))
        raise save_failed(save_dir, step, str(e), checkpoint_size(config, len(states)), read_latest(save_dir)) from None
