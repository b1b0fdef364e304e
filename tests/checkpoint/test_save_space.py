"""Saves and full disks: a failed save leaves nothing behind and `latest` where it was, dead jobs' staging
folders go at start-up, and a save directory short of one checkpoint is refused with the numbers.

A full disk is simulated by making the safetensors writer (or the write of `latest`) raise ENOSPC
after writing part of its file; free space by patching shutil.disk_usage.
"""

import errno
import os
import random
import shutil
import subprocess
from collections import namedtuple

import numpy
import pytest

from checkpoint_fixtures import snapshot, tiny, train_step, training_run
from megamamba.checkpoint import (
    CheckpointError,
    files,
    model_tensors,
    optimizer_groups,
    optimizer_tensors,
    save_checkpoint,
)
from megamamba.checkpoint.lock import LOCK_FILE, SaveDirLock
from megamamba.checkpoint.space import check_room, checkpoint_size, directory_bytes, size_text
from megamamba.checkpoint.startup import open_save_dir
from megamamba.checkpoint.store import JOB_TOKEN, read_latest, remove_leftovers

CONFIG = tiny("Mamba2")
Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def trained():
    """(model tensors, optimizer state, optimizer groups) after two AdamW steps of the tiny model."""
    model, optimizer, scheduler = training_run(CONFIG, seed=3)
    for step in range(2):
        train_step(model, optimizer, scheduler, step)
    return model_tensors(model), optimizer_tensors(optimizer, model), optimizer_groups(optimizer, model)


def save(save_dir, step: int, trained, keep_last=None) -> str:
    model, optimizer, groups = trained
    return save_checkpoint(
        str(save_dir), step, CONFIG, model, optimizer=optimizer, optimizer_groups=groups, keep_last=keep_last
    )


def full_disk_after(monkeypatch, files_written: int) -> None:
    """The safetensors writer writes `files_written` files, then half of the next one and raises ENOSPC."""
    original, count = files.write_safetensors, []

    def write(path, *args, **kwargs):
        original(path, *args, **kwargs)
        count.append(path)
        if len(count) > files_written:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_safetensors", write)


def test_a_save_that_fills_the_disk_leaves_nothing_behind_and_latest_on_the_previous_checkpoint(
    tmp_path, monkeypatch, trained
):
    save(tmp_path, 2, trained)
    before = snapshot(str(tmp_path))
    full_disk_after(monkeypatch, files_written=1)
    with pytest.raises(CheckpointError) as failure:
        save(tmp_path, 4, trained)
    needed = checkpoint_size(CONFIG, 1).total
    assert str(failure.value) == (
        f"the save of step 4 to {tmp_path} failed ([Errno 28] No space left on device); a checkpoint needs "
        f"{needed} bytes ({size_text(needed)}) in {tmp_path}; nothing of this save is left and "
        f"{tmp_path}/step_000002 is still the latest checkpoint: resume with --load {tmp_path} once there is room"
    )
    assert snapshot(str(tmp_path)) == before


def test_a_full_disk_when_latest_is_written_puts_the_replaced_checkpoint_back(tmp_path, monkeypatch, trained):
    save(tmp_path, 2, trained)
    save(tmp_path, 4, trained)
    before = snapshot(str(tmp_path))
    original = files.write_bytes

    def write_bytes(path, data):
        if os.path.basename(path) == "latest.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(path, data)

    monkeypatch.setattr(files, "write_bytes", write_bytes)
    with pytest.raises(CheckpointError, match=r"the save of step 4 .* failed \(\[Errno 28\]"):
        save(tmp_path, 4, trained)  # replaces step_000004: it is set aside, then must come back
    assert snapshot(str(tmp_path)) == before
    assert read_latest(str(tmp_path)) == "step_000004"


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_start_up_removes_dead_jobs_staging_folders_and_keeps_live_and_other_hosts_ones(tmp_path):
    host, dead_job = os.uname().nodename, dead_pid()
    dead = [f".tmp-step_000004-{dead_job}-abc123-{host}", f".old-step_000002-{dead_job}-abc123-{host}"]
    kept = [f".tmp-step_000004-{os.getpid()}-def456-{host}", f".tmp-step_000004-{dead_job}-abc123-elsewhere"]
    for name in dead + kept:
        os.makedirs(tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 100)
    lock = SaveDirLock(str(tmp_path), JOB_TOKEN)
    open_save_dir(lock, checkpoint_size(CONFIG, 1), 1)
    lock.release()
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert remove_leftovers(str(tmp_path)) == []


def test_the_predicted_checkpoint_size_is_its_tensors_exactly_and_bounds_the_whole(tmp_path, trained):
    size = checkpoint_size(CONFIG, 1)
    assert directory_bytes(save(tmp_path, 2, trained)) <= size.total
    model, optimizer, _ = trained
    assert size.weights == sum(t.numel() * 4 for t in model.values())
    assert size.optimizer == sum(t.numel() * 4 for t in optimizer.values())


def test_every_rank_predicts_the_same_size_whatever_its_random_state():
    before = checkpoint_size(CONFIG, 4)
    random.seed(12345)
    random.random()
    numpy.random.seed(7)
    numpy.random.standard_normal()
    assert checkpoint_size(CONFIG, 4) == before


def short_of(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))


def test_a_save_directory_short_of_a_checkpoint_is_refused_naming_the_oldest_checkpoints_to_remove(
    tmp_path, monkeypatch, trained
):
    for step in (2, 4, 6):
        save(tmp_path, step, trained)
    before = snapshot(str(tmp_path))
    size = checkpoint_size(CONFIG, 2)
    short_of(monkeypatch, size.total - 1000)
    oldest = directory_bytes(str(tmp_path / "step_000002"))
    with pytest.raises(CheckpointError) as refusal:
        open_save_dir(SaveDirLock(str(tmp_path), JOB_TOKEN), size, 2)
    assert str(refusal.value) == (
        f"--save {tmp_path}: {size.total - 1000} bytes ({size_text(size.total - 1000)}) free, but a checkpoint of "
        f"this model saved by 2 ranks needs {size.total} bytes: {size}, written in full before older checkpoints "
        f"are pruned; removing the oldest checkpoints step_000002 ({size_text(oldest)}) would make room; "
        "--keep-last N then keeps N checkpoints after each save"
    )
    assert snapshot(str(tmp_path)) == before and not os.path.exists(tmp_path / LOCK_FILE)


def test_a_save_directory_that_removing_checkpoints_cannot_help_is_told_how_much_to_free(tmp_path, monkeypatch):
    short_of(monkeypatch, 4096)
    size = checkpoint_size(CONFIG, 1)
    with pytest.raises(CheckpointError, match=rf"; free {size.total - 4096} bytes \(.* KiB\) there or choose another"):
        check_room(str(tmp_path), size, 1)
