"""One writer per save directory: the lock, its holder record, stale locks, and pruning that
touches only this job's staging folders and never the protected checkpoint."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from checkpoint_fixtures import tiny
from megamamba.checkpoint import CheckpointError, model_tensors, save_checkpoint
from megamamba.checkpoint.lock import LOCK_FILE, SaveDirLock, read_holder
from megamamba.checkpoint.store import JOB_TOKEN
from megamamba.model.lm import MambaLM


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_lock_on_the_directory_is_refused_naming_the_holder(tmp_path):
    first = SaveDirLock(str(tmp_path), "job-a")
    assert first.acquire() is None
    holder = read_holder(str(tmp_path / LOCK_FILE))
    assert holder["pid"] == os.getpid() and holder["token"] == "job-a" and holder["host"]
    with pytest.raises(CheckpointError, match=rf"is in use by another job: pid {os.getpid()} on host .*job job-a"):
        SaveDirLock(str(tmp_path), "job-b").acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second = SaveDirLock(str(tmp_path), "job-b")
    assert second.acquire() is None
    second.release()


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
    lock = SaveDirLock(str(tmp_path), "job-a")
    lock.acquire()
    code = (
        "import sys; from megamamba.checkpoint.lock import SaveDirLock\n"
        "try:\n    SaveDirLock(sys.argv[1], 'job-b').acquire()\nexcept Exception as e:\n    print(e); sys.exit(3)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    lock.release()
    assert proc.returncode == 3 and f"pid {os.getpid()}" in proc.stdout, proc.stdout + proc.stderr


def test_the_lock_file_of_a_dead_job_is_taken_over_and_returned(tmp_path):
    record = {"host": os.uname().nodename, "pid": dead_pid(), "started": 0, "token": "crashed"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    lock = SaveDirLock(str(tmp_path), "job-a")
    assert lock.acquire() == record
    assert read_holder(str(tmp_path / LOCK_FILE))["token"] == "job-a"
    lock.release()


def test_a_lock_held_while_its_recorded_holder_is_gone_is_reported_stale_with_the_fix(tmp_path):
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({"host": os.uname().nodename, "pid": dead_pid(), "started": 0, "token": "gone"}))
    with open(path) as inherited:  # as a child process that inherited the dead holder's descriptor
        fcntl.flock(inherited, fcntl.LOCK_EX)
        stale = rf"stale lock {path}: its holder pid \d+ .* is gone .* remove {path}"
        with pytest.raises(CheckpointError, match=stale):
            SaveDirLock(str(tmp_path), "job-a").acquire()
    assert read_holder(str(path))["token"] == "gone"


def save(directory, step, **kwargs):
    model = MambaLM(tiny("Mamba2"))
    return save_checkpoint(str(directory), step, model.config, model_tensors(model), **kwargs)


def test_pruning_removes_only_this_jobs_and_dead_jobs_leftovers(tmp_path):
    host = os.uname().nodename
    live = tmp_path / f".tmp-step_000002-{os.getppid()}-abcdef-{host}"  # a live job on this host
    elsewhere = tmp_path / f".old-step_000001-{dead_pid()}-abcdef-other-host"  # its pid means nothing here
    unknown = tmp_path / ".tmp-step_000002-4242"  # not a job token
    mine = tmp_path / f".tmp-step_000002-{JOB_TOKEN}"
    dead = tmp_path / f".tmp-step_000002-{dead_pid()}-abcdef-{host}"
    for folder in (live, elsewhere, unknown, mine, dead):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    save(tmp_path, 1, keep_last=1)
    for kept in (live, elsewhere, unknown):
        assert (kept / "model.safetensors").read_bytes() == b"partial"
    assert not mine.exists() and not dead.exists()


def test_keep_last_keeps_the_protected_checkpoint(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep_last=1, protect="step_000001")
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_000001", "step_000003"]
