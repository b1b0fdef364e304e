"""Save a checkpoint and get killed by SIGKILL at the N-th file primitive call (the crash test's child).

    python kill_during_save.py SAVE_DIR STEP SEED KEEP_LAST N torn|before

Saves `weights(SEED)` (test_checkpoint_store.weights) as checkpoint STEP; the N-th call of
write_file / write_tensors / sync_dir / rename / remove_tree kills this process, after writing
half of the file when "torn" and the call writes one. Exits 0 if fewer than N calls happen.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megamamba.checkpoint import files  # noqa: E402
from test_checkpoint_store import PRIMITIVES, WRITES, save  # noqa: E402


def main() -> None:
    save_dir, step, seed, keep_last, at, mode = sys.argv[1:]
    calls = []
    for name in PRIMITIVES:
        original = getattr(files, name)

        def primitive(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            if len(calls) != int(at):
                return _original(*args, **kwargs)
            if mode == "torn" and _name in WRITES:
                _original(*args, **kwargs)
                with open(args[0], "r+b") as f:
                    f.truncate(os.path.getsize(args[0]) // 2)
                    os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(files, name, primitive)
    save(save_dir, int(step), int(keep_last), seed=int(seed))


if __name__ == "__main__":
    main()
