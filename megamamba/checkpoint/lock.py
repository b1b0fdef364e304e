"""One writer per save directory: an exclusive advisory lock held for a job's life.

`<save>/.megamamba-lock` is locked with `fcntl.flock` by the committing process (global rank 0)
at start-up and records its holder (host, pid, start time, job token) as JSON. A second job on
the same directory cannot take it and fails with the holder's name. The kernel drops a flock
when its holder's file is closed, so a crashed job leaves only the file behind, which the next
job takes over; a lock still held while its recorded holder is gone (a child process that
inherited it, a network filesystem that kept it) is reported as stale, with how to clear it.
On release the file is removed, so a run that leaves cleanly leaves no trace.

The job token names this job's staging folders (store.py), so pruning never touches another's.
"""

import fcntl
import json
import os
import socket
import time
from typing import Optional

from megamamba.checkpoint.files import CheckpointError

LOCK_FILE = ".megamamba-lock"


def read_holder(path: str) -> Optional[dict]:
    """The holder record in a lock file, None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def pid_alive(pid) -> bool:
    """Whether a process `pid` exists on this host (True when that cannot be told)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


def describe(holder: Optional[dict]) -> str:
    if not holder:
        return "an unknown holder (the lock file holds no record)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (job {holder.get('token')}, started {started})"


class SaveDirLock:
    """The lock of `save_dir` for job `token`; `acquire()` takes it or raises CheckpointError naming the holder."""

    def __init__(self, save_dir: str, token: str):
        self.save_dir, self.token = save_dir, token
        self.path = os.path.join(save_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[dict]:
        """Take the lock; returns the record of a dead job's lock taken over (None when there was none)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(self._held_message()) from None
            except OSError as e:
                os.close(fd)
                raise CheckpointError(
                    f"--save {self.save_dir}: cannot lock {self.path} ({e.strerror}); the filesystem must support flock"
                ) from None
            try:  # the holder we waited on may have removed the file: then lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = read_holder(self.path)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": self.token}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def _held_message(self) -> str:
        holder = read_holder(self.path)
        held = (
            f"--save {self.save_dir} is in use by another job: {describe(holder)} holds {self.path}; one job "
            "writes a save directory at a time: wait for it to end or choose another --save"
        )
        if holder and holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid")):
            return (
                f"--save {self.save_dir}: stale lock {self.path}: its holder {describe(holder)} is gone but the "
                f"lock is still held (by a process it started, or kept by the filesystem); end that job's "
                f"leftover processes (fuser -v {self.path}), or remove {self.path} if none remain"
            )
        return held

    def release(self) -> None:
        """Remove the lock file (when still ours) and drop the lock; idempotent."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
