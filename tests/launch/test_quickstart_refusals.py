"""scripts/quickstart.sh never touches another quick start's outputs: it refuses, in one line and before any
work, an output folder that another quick start is writing or that holds an earlier one's outputs, and the
hybrid quick start writes to its own folder by default.

No training here (test_quickstart.py runs it): the script runs in a copy of the checkout whose `.venv` holds
stubs: `python` waits for a file the test writes, `deepspeed` fails.
"""

import os
import shutil
import subprocess
import time

import pytest

from train_entry import ROOT

SCRIPT = ROOT / "scripts/quickstart.sh"
STUB_PYTHON = '#!/bin/sh\ntouch "$STUB_STARTED"\nwhile [ ! -e "$STUB_RELEASE" ]; do sleep 0.02; done\n'


@pytest.fixture
def checkout_copy(tmp_path):
    """A folder with scripts/quickstart.sh and a .venv of stubs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    (tmp_path / ".venv/bin").mkdir(parents=True)
    for name, text in (("python", STUB_PYTHON), ("deepspeed", "#!/bin/sh\nexit 1\n")):
        (tmp_path / ".venv/bin" / name).write_text(text)
        (tmp_path / ".venv/bin" / name).chmod(0o755)
    return tmp_path


def quickstart(script, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *map(str, args)], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def snapshot(folder) -> dict:
    """Relative path -> bytes of every file under `folder` (folders as None)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def earlier_quick_start(out):
    """What a quick start leaves in `out`, in part."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "spm.model").write_bytes(b"a tokenizer")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step_000200")
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 7.6}\n')


def test_a_second_quick_start_into_the_same_folder_is_refused_and_the_first_goes_on(checkout_copy):
    """The first one is held in its step 1 (the stub Python waits) while the second runs."""
    script, out = checkout_copy / "scripts/quickstart.sh", checkout_copy / "runs/quickstart"
    started, release = checkout_copy / "started", checkout_copy / "release"
    env = {**os.environ, "STUB_STARTED": str(started), "STUB_RELEASE": str(release)}
    first = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not started.exists():
            assert first.poll() is None, first.communicate()
            time.sleep(0.02)
        before = snapshot(out)
        second = quickstart(script)
        assert snapshot(out) == before
    finally:
        release.touch()
        stdout, stderr = first.communicate(timeout=60)
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr == (
        "quickstart: runs/quickstart is in use by another quick start; wait for it to end or give another OUTPUT_DIR\n"
    )
    assert "== 4/5 deepspeed" in stdout, stdout  # the first went on to train (where the stub DeepSpeed fails)
    assert stderr == "quickstart: training failed (exit status 1)\n"


def test_a_quick_start_into_a_folder_holding_an_earlier_ones_outputs_is_refused(tmp_path):
    out = tmp_path / "quickstart"
    earlier_quick_start(out)
    before = snapshot(tmp_path)
    proc = quickstart(SCRIPT, out)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"quickstart: {out} holds an earlier quick start's outputs (data checkpoints metrics.jsonl); give "
        "another OUTPUT_DIR, or remove them to run here again\n"
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "pattern,folder", [("", "runs/quickstart"), ("M*M-", "runs/quickstart-hybrid")], ids=["mamba2", "hybrid"]
)
def test_each_quick_start_of_the_readme_has_its_own_default_folder(checkout_copy, pattern, folder):
    """Both default folders hold earlier outputs: each quick start is refused for its own."""
    for default in ("runs/quickstart", "runs/quickstart-hybrid"):
        earlier_quick_start(checkout_copy / default)
    proc = quickstart(checkout_copy / "scripts/quickstart.sh", QUICKSTART_PATTERN=pattern)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"quickstart: {folder} holds an earlier quick start's outputs"), proc.stderr
