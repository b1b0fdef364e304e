"""The manifest: written last into a checkpoint, it is what makes the checkpoint complete.

`manifest.json` lists every other file of the checkpoint directory with its size and sha256,
plus the tag and step. A directory without a valid manifest is an unfinished save; a file
whose size or hash differs from its entry is truncated or corrupt. Hashing reads every byte
(about 1-2 GB/s), so `verify(..., hashes=False)` checks only presence and sizes.
"""

import hashlib
import json
import os
from typing import Optional

from megamamba.checkpoint import files
from megamamba.checkpoint.files import CheckpointError, read_json

MANIFEST = "manifest.json"
FORMAT = "megamamba-checkpoint"
VERSION = 1


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str, tag: str, step: int, known: Optional[dict] = None) -> dict:
    """Write manifest.json (fsynced) listing every file of `directory`, and sync the directory.

    known: {file: {"size", "sha256"}} of files their writers (other processes) fsynced and hashed;
    each must be present with that size. Every other file is fsynced and hashed here.
    """
    known = known or {}
    names = sorted(os.listdir(directory))
    absent = sorted(set(known) - set(names))
    if absent:
        raise CheckpointError(f"{directory}: {absent[:5]} were written by other processes but are not here")
    entries = {}
    for name in names:
        path = os.path.join(directory, name)
        if name == MANIFEST or not os.path.isfile(path):
            raise CheckpointError(f"{path}: a checkpoint holds only plain files and no manifest before it is complete")
        if name in known:
            entry = {"size": known[name]["size"], "sha256": known[name]["sha256"]}
            if os.path.getsize(path) != entry["size"]:
                raise CheckpointError(f"{path}: {os.path.getsize(path)} bytes, its writer wrote {entry['size']}")
        else:
            files.fsync_file(path)
            entry = {"size": os.path.getsize(path), "sha256": sha256_of(path)}
        entries[name] = entry
    manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "step": step, "files": entries}
    files.write_json(os.path.join(directory, MANIFEST), manifest)
    files.sync_dir(directory)
    return manifest


def _valid_entry(name, entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and not isinstance(entry["size"], bool)
        and entry["size"] >= 0
        and isinstance(entry.get("sha256"), str)
        and os.path.basename(name) == name
        and name not in ("", ".", "..")
    )


def verify(directory: str, hashes: bool = True) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming the first problem otherwise."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: incomplete checkpoint, no {MANIFEST} (its save did not finish)")
    manifest = read_json(path, "checkpoint manifest")
    files_listed = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
    if not files_listed or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')!r}, this code reads version {VERSION}")
    for name, entry in manifest["files"].items():
        if not _valid_entry(name, entry):
            raise CheckpointError(
                f"{path}: the entry of {name!r} is {json.dumps(entry)[:80]}; each entry is "
                '{"size": bytes, "sha256": hex digest} of a file in the checkpoint directory'
            )
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (listed in {MANIFEST}); the checkpoint is damaged")
        size = os.path.getsize(file)
        if size != entry["size"]:
            raise CheckpointError(
                f"{file}: {size} bytes, {MANIFEST} says {entry['size']}: the file is truncated or "
                "corrupt; resume from another checkpoint"
            )
        if hashes and sha256_of(file) != entry["sha256"]:
            raise CheckpointError(
                f"{file}: sha256 differs from {MANIFEST}: the file is corrupt; resume from another checkpoint"
            )
    return manifest
