"""The disk space one checkpoint takes, predicted from the model config, and what a save directory short of it says.

A checkpoint holds every parameter of the config as float32 (the master weights), AdamW's two float32
moments and a 0-d `step` per parameter, each rank's RNG file, and the metadata of every file: the
safetensors headers, the pieces' records and indexes (counted as if every writer held a piece of every
tensor, an upper bound), config.json and the manifest. Not counted: the trainer's state JSON and the
tokenizer's files (kilobytes; a few megabytes for a large vocabulary). A save stages the whole new
checkpoint before it prunes older ones, so a save directory needs this much free beside the checkpoints
already there.
"""

import json
import math
import os
import shutil
from typing import NamedTuple, Optional

from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.checkpoint import parameter_shapes
from megamamba.checkpoint.files import CheckpointError
from megamamba.checkpoint.store import checkpoint_tags
from megamamba.config import MambaConfig

FLOAT32 = 4
MOMENTS = ("exp_avg", "exp_avg_sq")
WIDEST_FLOAT = -2.2250738585072014e-308  # a float whose JSON is as long as any


class CheckpointSize(NamedTuple):
    """Bytes of one checkpoint: the weights, the optimizer state, and the rest (RNG files, metadata)."""

    weights: int
    optimizer: int
    rest: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.rest

    def __str__(self) -> str:
        return (
            f"{size_text(self.total)} (weights {size_text(self.weights)}, optimizer state "
            f"{size_text(self.optimizer)}, RNG states and metadata {size_text(self.rest)})"
        )


def size_text(n: int) -> str:
    """Bytes as people read them: 1536 -> '1.5 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _piece_metadata(name: str, shape: tuple, writers: int) -> int:
    """Bytes one writer's piece of the tensor `name` adds to a checkpoint's metadata, at most: its safetensors
    header entry (padded to 8 bytes), its piece record in that header and in the index, and its index entry."""
    numel = math.prod(shape)
    key = f"{name}@{writers}.0"
    record = {"name": name, "shape": list(shape), "dim": 0, "rows": [[0, numel]], "local_shape": list(shape)}
    record["flat"] = [0, numel]
    entry = {key: {"dtype": "F32", "shape": list(shape), "data_offsets": [FLOAT32 * numel, 2 * FLOAT32 * numel]}}
    in_header = len(json.dumps(json.dumps({key: record}))) + len(json.dumps(entry, separators=(",", ":"))) + 8
    in_index = len(json.dumps({key: record}, indent=2)) + len(
        json.dumps({key: f"optimizer-rank-{writers:05d}.safetensors"})
    )
    return in_header + in_index


def _rng_file() -> int:
    """Bytes of one rank's RNG file: this process's generator tensors, and its Python and NumPy numbers at
    their widest in JSON (so that every rank predicts the same size)."""
    state = rng_files.capture_rng()
    version, words, _ = state["python"]
    state["python"] = [version, [2**32 - 1] * len(words), WIDEST_FLOAT]
    state["numpy"] = {**state["numpy"], "pos": len(words), "has_gauss": 1, "cached_gaussian": WIDEST_FLOAT}
    tensors, metadata = rng_files.to_file([state])
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    header = sum(_piece_metadata(name, tuple(t.shape), 1) for name, t in tensors.items())
    return data + header + len(json.dumps(json.dumps(metadata)))


def _manifest_entry() -> int:
    return len(json.dumps({"rng-rank-00000.safetensors": {"sha256": "0" * 64, "size": 2**40}}, indent=2))


def checkpoint_size(config: MambaConfig, world_size: int) -> CheckpointSize:
    """The bytes of a checkpoint of `config` saved by `world_size` ranks (see the module docstring)."""
    shapes = parameter_shapes(config)
    numel = sum(math.prod(shape) for shape in shapes.values())
    stored = list(shapes.items())
    stored += [(f"{name}/{key}", shape) for name, shape in shapes.items() for key in MOMENTS]
    stored += [(f"{name}/step", ()) for name in shapes]
    metadata = world_size * sum(_piece_metadata(name, shape, world_size) for name, shape in stored)
    files = 3 * world_size + 5  # model, optimizer and RNG files; two indexes, config, state, manifest
    config_json = len(json.dumps(config.to_dict(), indent=2, sort_keys=True)) + 1
    rest = world_size * _rng_file() + metadata + config_json + files * _manifest_entry()
    return CheckpointSize(FLOAT32 * numel, FLOAT32 * (len(MOMENTS) * numel + len(shapes)), rest)


def directory_bytes(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def save_failed(save_dir: str, step: int, cause: str, size: CheckpointSize, latest: Optional[str]) -> CheckpointError:
    """The one line of a save of `step` that failed once what it staged is removed (`cause`: what the failing
    rank said; `latest`: the tag `latest` names now)."""
    needs = f"a checkpoint needs {size.total} bytes ({size_text(size.total)}) in {save_dir}"
    kept = (
        f"{os.path.join(save_dir, latest)} is still the latest checkpoint: resume with --load {save_dir} once "
        "there is room"
        if latest
        else "there is no checkpoint yet: rerun once there is room"
    )
    return CheckpointError(
        f"the save of step {step} to {save_dir} failed ({cause}); {needs}; nothing of this save is left and {kept}"
    )


def check_room(save_dir: str, size: CheckpointSize, world_size: int) -> None:
    """CheckpointError, with the numbers, when `save_dir` has less free space than one checkpoint of `size`
    (saved by `world_size` ranks); it names the oldest checkpoints whose removal would make room, if any would."""
    free = shutil.disk_usage(save_dir).free
    if free >= size.total:
        return
    short = size.total - free
    older = checkpoint_tags(save_dir)[1:]  # the newest stays: it is the one to resume from
    freed, removable = 0, []
    for tag in reversed(older):
        if freed >= short:
            break
        removable.append(tag)
        freed += directory_bytes(os.path.join(save_dir, tag))
    way_out = (
        f"removing the oldest checkpoints {', '.join(removable)} ({size_text(freed)}) would make room; "
        "--keep-last N then keeps N checkpoints after each save"
        if removable and freed >= short
        else f"free {short} bytes ({size_text(short)}) there or choose another --save"
    )
    raise CheckpointError(
        f"--save {save_dir}: {free} bytes ({size_text(free)}) free, but a checkpoint of this model saved by "
        f"{world_size} rank{'s' if world_size > 1 else ''} needs {size.total} bytes: {size}, written in full "
        f"before older checkpoints are pruned; {way_out}"
    )
