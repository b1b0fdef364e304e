"""Faults the resume and fault tests inject into a training run's ranks, by patching product functions.

`install(nan_steps=..., kill_save=(step, at), interrupt=(step, at))` in a rank, before launch/train.py runs:
- nan_steps: global rank 0's first trainable parameter gets a NaN gradient in those (0-based) global
  steps (patched: `NonFiniteGuard.__init__`, which gets the run's trainer);
- kill_save: every rank SIGKILLs itself at its own at-th file primitive (write, directory fsync,
  rename, delete of megamamba.checkpoint.files) of the save after `step` steps (patched:
  `checkpointing.save`): ranks write their pieces and RNG file, rank 0 also the staging directory,
  indexes, manifest and commit;
- interrupt: (step, at) every rank sends itself SIGINT (as Ctrl-C does) when global step `step` starts
  (patched: `TrainingLoop.step`), and again at its at-th file primitive of the save that follows
  (at None: only once).

`python tests/fault_injection.py FAULTS_JSON ARGV...` installs FAULTS_JSON's keywords and runs
launch/train.py ARGV as `python launch/train.py ARGV` would.
"""

import json
import math
import os
import runpy
import signal
import sys
from pathlib import Path

TRAIN_PY = Path(__file__).resolve().parents[1] / "launch" / "train.py"
PRIMITIVES = ("write_file", "write_tensors", "write_bytes", "sync_dir", "rename", "remove_tree")


def install(nan_steps=(), kill_save=None, interrupt=None) -> None:
    if nan_steps:
        _nan_gradients(set(nan_steps))
    if kill_save:
        _kill_during_save(*kill_save)
    if interrupt:
        _interrupt(*interrupt)


def _nan_gradients(steps: set) -> None:
    import torch
    import torch.distributed as dist

    from megamamba.pipelines.loop.faults import NonFiniteGuard

    original = NonFiniteGuard.__init__

    def init(self, trainer, *args, **kwargs):
        original(self, trainer, *args, **kwargs)
        if dist.get_rank() == 0:
            first = next(p for _, _, p in trainer.named_parameters() if p.requires_grad)
            first.register_hook(lambda g: torch.full_like(g, math.nan) if trainer.global_step() in steps else g)

    NonFiniteGuard.__init__ = init


def _signal_during_save(step: int, at: int, signum: int) -> None:
    """`signum` to this process at its at-th file primitive of the save after `step` steps."""
    from megamamba.checkpoint import files
    from megamamba.pipelines.job import checkpointing

    original, calls = checkpointing.save, []

    def count(primitive):
        def counted(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                os.kill(os.getpid(), signum)
            return primitive(*args, **kwargs)

        return counted

    def save(trainer, config, save_dir, steps_done, **kwargs):
        if steps_done == step:
            for name in PRIMITIVES:
                setattr(files, name, count(getattr(files, name)))
        return original(trainer, config, save_dir, steps_done, **kwargs)

    checkpointing.save = save


def _kill_during_save(step: int, at: int) -> None:
    _signal_during_save(step, at, signal.SIGKILL)


def _interrupt(step: int, at=None) -> None:
    from megamamba.pipelines.loop.training import TrainingLoop

    original = TrainingLoop.step

    def first_interrupt(self, global_step):
        if global_step == step:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, global_step)

    TrainingLoop.step = first_interrupt
    if at is not None:
        _signal_during_save(step + 1, at, signal.SIGINT)


if __name__ == "__main__":
    faults, sys.argv = json.loads(sys.argv[1]), [str(TRAIN_PY), *sys.argv[2:]]
    sys.path[0] = str(TRAIN_PY.parent)
    install(**faults)
    runpy.run_path(str(TRAIN_PY), run_name="__main__")
