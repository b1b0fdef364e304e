"""A node's note of the `.bin` files whose checksum it has verified, so that the ranks of a node and its later
start-ups read a file once until it changes.

A note is kept per user in the node's temporary directory, keyed by the file's path, and holds the file's
device, inode, size, modification and status-change times (ns) with the checksum it was found to have. Any
write to the file, and any `touch` that puts its modification time back, moves its status-change time, which
no user can set. As git does for its index, a note is trusted only for a file whose status-change time is at
least `SETTLED_NS` older than the check that wrote it: a change within the same clock tick as the file's
previous one would keep that time.
"""

import hashlib
import json
import os
import tempfile
from typing import Optional

SETTLED_NS = 2_000_000_000


def _folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"megamamba-{os.getuid()}", "verified-datasets")


def note_path(bin_path: str) -> str:
    """Where this node keeps its note on `bin_path`."""
    key = hashlib.sha256(os.path.realpath(bin_path).encode()).hexdigest()[:32]
    return os.path.join(_folder(), key + ".json")


def lock_path(bin_path: str) -> str:
    """The lock the ranks of a node take to check `bin_path` one at a time (its folder made if missing)."""
    try:
        os.makedirs(_folder(), mode=0o700, exist_ok=True)
    except OSError:
        pass  # exclusive_lock then holds none, and each rank checks the file itself
    return note_path(bin_path) + ".lock"


def _identity(stat: os.stat_result) -> dict:
    return {
        "device": stat.st_dev,
        "inode": stat.st_ino,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
    }


def verified_checksum(bin_path: str) -> Optional[str]:
    """The checksum a note records for `bin_path` as it is now, or None (no note, or the file changed since)."""
    try:
        with open(note_path(bin_path)) as f:
            note = json.load(f)
        stat = os.stat(bin_path)
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or note.get("file") != _identity(stat):
        return None
    if note.get("checked_at_ns", 0) - stat.st_ctime_ns < SETTLED_NS:
        return None
    checksum = note.get("checksum")
    return checksum if isinstance(checksum, str) else None


def note_verified(bin_path: str, stat_before: os.stat_result, checksum: str, checked_at_ns: int) -> None:
    """Record that `bin_path`, whose stat was `stat_before` when the check began at `checked_at_ns`, has
    `checksum`; nothing when the file changed during the check or the note cannot be written."""
    try:
        if _identity(os.stat(bin_path)) != _identity(stat_before):
            return
        note = {"file": _identity(stat_before), "checksum": checksum, "checked_at_ns": checked_at_ns}
        with tempfile.NamedTemporaryFile("w", dir=_folder(), suffix=".tmp", delete=False) as f:
            json.dump(note, f)
        os.replace(f.name, note_path(bin_path))
    except OSError:
        return
