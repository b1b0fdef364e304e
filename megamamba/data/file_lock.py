"""The advisory lock by which one process of many does a dataset's one-time work (vocab_check, epoch_index)."""

import contextlib
import fcntl


def exclusive_lock(path: str):
    """A context holding an exclusive flock on `path` (created if missing, opened for writing: NFS
    emulates flock with fcntl locks, which refuse an exclusive lock on a read-only descriptor) until it
    exits; where `path` cannot be created or the filesystem refuses the lock, one holding none."""
    try:
        f = open(path, "a")
    except OSError:
        return contextlib.nullcontext()
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except OSError:
        pass
    return f
