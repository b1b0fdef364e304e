"""Durable file operations, the only ones checkpoint code uses to change the disk.

A write is durable once the file's bytes are fsynced and the directory entry naming it is
fsynced too; a rename is durable once the directory holding the new name is fsynced. Every
step of a save goes through `write_file`, `write_tensors`, `sync_dir`, `rename` or `remove_tree`, so a crash
leaves the disk as it was after the last completed step (the crash tests interrupt each one).
Readers raise `CheckpointError` with one message naming the file and what is wrong.
"""

import json
import os
import shutil
from typing import IO, Callable

from megamamba.checkpoint.model_folder import ModelFolderError, read_weights
from megamamba.checkpoint.safetensors_stream import DTYPE_NAMES, TensorSpec, write_safetensors
from megamamba.errors import MegamambaError


class CheckpointError(MegamambaError):
    """A checkpoint or save directory that cannot be used; the message says what and how to fix it."""


def fsync_file(path: str) -> None:
    """fsync a file written by other code (e.g. a tokenizer's `save`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: str) -> None:
    """fsync a directory, making the names created, renamed or removed in it durable."""
    fsync_file(path)


def write_file(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create `path` with `write(f)` and fsync it (its directory is synced by the caller)."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(path: str, data: bytes) -> None:
    write_file(path, lambda f: f.write(data))


def write_json(path: str, obj) -> None:
    """JSON text (Infinity allowed, as Python and transformers read it), fsynced."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_tensors(path: str, tensors: dict, metadata: dict = None) -> None:
    """A safetensors file of `tensors` (on any device), fsynced; one tensor at a time is copied to the host."""
    specs = [TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    write_safetensors(path, specs, tensors.__getitem__, metadata or {})
    fsync_file(path)


def rename(src: str, dst: str) -> None:
    """os.replace, made durable by syncing the destination's directory."""
    os.replace(src, dst)
    sync_dir(os.path.dirname(os.path.abspath(dst)))


def remove_tree(path: str) -> None:
    """Delete a directory tree and sync its parent."""
    shutil.rmtree(path)
    sync_dir(os.path.dirname(os.path.abspath(path)))


def read_json(path: str, what: str = "JSON file"):
    """Parsed JSON of `path`; CheckpointError for a missing or malformed file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{what} {path}: cannot be read ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def read_tensors(path: str) -> dict:
    """Every tensor of a safetensors file, on the CPU; CheckpointError when it is missing or unreadable."""
    try:
        return read_weights(path)
    except ModelFolderError as e:
        raise CheckpointError(str(e)) from None
