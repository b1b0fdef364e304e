"""train.py and a save directory short of space: start-up removes dead jobs' staging folders, then refuses
in one line, with the numbers, a --save whose free space is below one checkpoint; a full disk mid-save is
one line naming --save and the bytes needed, with the previous checkpoint intact and still `latest`.

train.py's main runs in this process as rank 0 of 1 (gloo); free space comes from a patched
shutil.disk_usage, and the full disk from a safetensors writer patched to raise ENOSPC.
"""

import errno
import os
import shutil
import subprocess

import pytest
import torch.distributed as dist

from distributed import free_port
from megamamba import MambaConfig, MambaLM
from megamamba.checkpoint import Checkpoint, files, model_tensors, save_checkpoint
from megamamba.checkpoint.lock import LOCK_FILE
from megamamba.checkpoint.space import checkpoint_size, directory_bytes, size_text
from megamamba.checkpoint.store import read_latest
from resume_runs import snapshot
from train_entry import load_train_script

real_disk_usage = shutil.disk_usage


@pytest.fixture
def rank_0_of_1(monkeypatch):
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def train(argv, capsys) -> tuple:
    """(exit status, stderr lines) of train.py's main."""
    with pytest.raises(SystemExit) as exit_info:
        load_train_script().main(argv)
    assert not dist.is_initialized()
    return exit_info.value.code, capsys.readouterr().err.splitlines()


def with_checkpoints(resume_runs, save, steps) -> MambaConfig:
    """Checkpoints (the weights alone) of the runs' model at `steps` in `save`; the model config."""
    config = MambaConfig.from_json(resume_runs.model_config())
    weights = model_tensors(MambaLM(config))
    for step in steps:
        save_checkpoint(str(save), step, config, weights)
    return config


def free_space(monkeypatch, save, free: int) -> None:
    def disk_usage(path):
        usage = real_disk_usage(path)
        return usage._replace(free=free) if os.path.samefile(path, save) else usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_a_save_directory_short_of_one_checkpoint_is_refused_with_the_numbers(
    resume_runs, rank_0_of_1, monkeypatch, capsys
):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    config = with_checkpoints(resume_runs, save, (2, 4))
    before = snapshot(str(save))
    size = checkpoint_size(config, 1)
    free_space(monkeypatch, save, size.total - 1)
    status, lines = train(resume_runs.argv(out, zero=0, flags=["--save", str(save), "--load", "auto"]), capsys)
    oldest = directory_bytes(str(save / "step_000002"))
    assert (status, lines) == (
        2,
        [
            f"train.py: error: rank 0: --save {save}: {size.total - 1} bytes ({size_text(size.total - 1)}) free, "
            f"but a checkpoint of this model saved by 1 rank needs {size.total} bytes: {size}, written in full before "
            f"older checkpoints are pruned; removing the oldest checkpoints step_000002 ({size_text(oldest)}) "
            "would make room; --keep-last N then keeps N checkpoints after each save"
        ],
    )
    assert snapshot(str(save)) == before and not (save / LOCK_FILE).exists()


def test_start_up_removes_a_dead_jobs_staging_folder_before_it_measures_the_free_space(
    resume_runs, rank_0_of_1, monkeypatch, capsys
):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    with_checkpoints(resume_runs, save, (2,))
    before = snapshot(str(save))
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = save / f".tmp-step_000004-{dead.pid}-abc123-{os.uname().nodename}"
    leftover.mkdir()
    (leftover / "model-rank-00000.safetensors").write_bytes(b"x" * 4096)
    free_space(monkeypatch, save, 0)
    status, lines = train(resume_runs.argv(out, zero=0, flags=["--save", str(save)]), capsys)
    assert (
        status == 2 and len(lines) == 1 and lines[0].startswith(f"train.py: error: rank 0: --save {save}: 0 bytes")
    ), lines
    assert snapshot(str(save)) == before


def test_a_full_disk_mid_save_is_one_line_and_the_previous_checkpoint_stays_latest(
    resume_runs, rank_0_of_1, monkeypatch, capsys
):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    write = files.write_safetensors

    def fills_the_disk_at_step_4(path, *args, **kwargs):
        write(path, *args, **kwargs)
        if "step_000004" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_safetensors", fills_the_disk_at_step_4)
    status, lines = train(resume_runs.argv(out, zero=0, flags=["--save", str(save), "--save-interval", "2"]), capsys)
    size = checkpoint_size(MambaConfig.from_json(resume_runs.model_config()), 1).total
    assert (status, lines) == (
        2,
        [
            f"train.py: error: the save of step 4 to {save} failed (rank 0: [Errno 28] No space left on device); a "
            f"checkpoint needs {size} bytes ({size_text(size)}) in {save}; nothing of this save is left and "
            f"{save}/step_000002 is still the latest checkpoint: resume with --load {save} once there is room"
        ],
    )
    assert sorted(os.listdir(save)) == ["latest", "step_000002"] and read_latest(str(save)) == "step_000002"
    assert Checkpoint(str(save / "step_000002"), hashes=True).step == 2  # every file as its manifest says
    assert directory_bytes(str(save / "step_000002")) <= size <= 1.05 * directory_bytes(str(save / "step_000002"))
