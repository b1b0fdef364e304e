"""Expensive runs made once per test session, also when pytest-xdist splits the session over workers.

A run is keyed by what makes it (layout, model, flags); its result is pickled beside its output folder in a
directory all workers share, under a lock, so the worker that asks second waits for the first one's run
instead of making its own. A run that raises is not kept.
"""

import fcntl
import hashlib
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder under the session's temporary root that every xdist worker of the session sees."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # each worker's own root is <session root>/popen-gwN
    path = base / name
    path.mkdir(exist_ok=True)
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader in another worker sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunCache:
    def __init__(self, root: Path):
        self.root = root
        self._memory: dict[str, Any] = {}

    def get(self, key, make: Callable[[Path], Any]) -> Any:
        """The result of `make(out)` for `key`, made once in the session; `out` is the run's own empty folder."""
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        if digest not in self._memory:
            with open(self.root / f"{digest}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                result = self.root / f"{digest}.pickle"
                if not result.exists():
                    out = self.root / digest
                    shutil.rmtree(out, ignore_errors=True)  # what a run that raised left
                    out.mkdir()
                    tmp = result.with_name(f".{result.name}.{os.getpid()}")
                    tmp.write_bytes(pickle.dumps(make(out)))
                    os.replace(tmp, result)
                self._memory[digest] = pickle.loads(result.read_bytes())
        return self._memory[digest]
