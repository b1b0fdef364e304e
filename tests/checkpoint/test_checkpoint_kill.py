"""`kill -9` during a save, at several points: the previous checkpoint stays loadable and `--load auto` finds it.

The saving process (kill_during_save.py) gets SIGKILL at chosen file primitive calls: tearing
the first tensor file and the manifest (half written), just before the checkpoint directory's
rename, before `latest` is switched, and before the oldest checkpoint is pruned. Nothing in the
dying process cleans up; the test then checks the directory as a restarted job would.
"""

import os
import signal
import subprocess
import sys

import pytest

from test_checkpoint_store import SCENARIOS, assert_recovers, primitive_calls, save

pytestmark = pytest.mark.slow

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_during_save.py")


def kill_points(calls: list) -> list:
    """(1-based call index, mode, what it is) of the interesting moments of a save."""
    first_rename = calls.index("rename")
    manifest = max(i for i in range(first_rename) if calls[i] == "write_file")
    return [
        (calls.index("write_tensors") + 1, "torn", "model.safetensors half written"),
        (manifest + 1, "torn", "manifest.json half written"),
        (first_rename + 1, "before", "before the rename into place"),
        (first_rename + 1 + calls[first_rename + 1 :].index("rename") + 1, "before", "before latest is switched"),
        (calls.index("remove_tree") + 1, "before", "before the oldest checkpoint is pruned"),
    ]


@pytest.mark.parametrize("scenario", ["new"])
def test_sigkill_during_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, scenario):
    before, (step, seed), keep_last, _ = SCENARIOS[scenario]
    calls = primitive_calls(tmp_path, monkeypatch, scenario)
    for at, mode, what in kill_points(calls):
        save_dir = tmp_path / f"kill{at}"
        for s, w in before:
            save(save_dir, s, keep_last, seed=w)
        child = subprocess.run(
            [sys.executable, CHILD, str(save_dir), str(step), str(seed), str(keep_last), str(at), mode],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == -signal.SIGKILL, (what, child.returncode, child.stderr[-2000:])
        assert_recovers(save_dir, scenario, f"killed {what} (call {at} of {calls})")
