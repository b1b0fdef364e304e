"""Bad input through train.py: one clear message on stderr, exit status 2, nothing on disk changed.

Each case works on a copy of the (1,1,1) reference's save directory (step_000004, step_000008,
latest) and passes it as --save too, so an overwrite would show in the snapshot.
"""

import os
import shutil

import pytest

from resume_runs import errors, snapshot

pytestmark = pytest.mark.slow


@pytest.fixture
def save(resume_reference, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(resume_reference["dir"] / "ckpt", copy)
    return copy


def refused(resume_runs, argv, directory, match):
    before = snapshot(directory)
    out = resume_runs.new_dir()
    run = resume_runs.direct(argv(out), out=out)
    assert run["returncode"] == 2, run["stderr"][-3000:]
    lines = errors(run["stderr"])
    assert len(lines) == 1 and match in lines[0], run["stderr"][-3000:]
    assert "| loss " not in run["stdout"]
    assert snapshot(directory) == before
    return lines[0]


def test_truncated_checkpoint_file(resume_runs, save):
    path = save / "step_000008" / "optimizer-rank-00000.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    refused(
        resume_runs,
        lambda out: resume_runs.argv(out, zero=0, flags=["--load", str(save / "step_000008"), "--save", str(save)]),
        save,
        "optimizer-rank-00000.safetensors: ",
    )


def test_corrupt_checkpoint_file_of_the_right_size(resume_runs, save):
    path = save / "step_000008" / "model-rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    refused(
        resume_runs,
        lambda out: resume_runs.argv(out, zero=0, flags=["--load", str(save), "--save", str(save)]),
        save,
        "model-rank-00000.safetensors: sha256 differs from manifest.json",
    )


def test_checkpoint_of_another_model_config(resume_runs, save):
    def argv(out):
        args = resume_runs.argv(out, zero=0, flags=["--load", "auto", "--save", str(save)])
        args[args.index("--model-config") + 1] = resume_runs.model_config(d_model=32)
        return args

    line = refused(resume_runs, argv, save, "the model config differs from the run's")
    assert "d_model: checkpoint 64, run 32" in line


def test_missing_latest(resume_runs, save):
    os.remove(save / "latest")
    refused(
        resume_runs,
        lambda out: resume_runs.argv(out, zero=0, flags=["--load", str(save), "--save", str(save)]),
        save,
        "no 'latest' file",
    )


@pytest.mark.parametrize("flag", ["--deepspeed_config", "--model-config"])
def test_malformed_json_config(resume_runs, save, tmp_path, flag):
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,\n "zero_optimization": ')

    def argv(out):
        args = resume_runs.argv(out, zero=0, flags=["--load", "auto", "--save", str(save)])
        args[args.index(flag) + 1] = str(broken)
        return args

    refused(resume_runs, argv, save, f"{flag} '{broken}': Expecting value: line 2")


def test_save_directory_that_cannot_be_created(resume_runs, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    refused(
        resume_runs,
        lambda out: resume_runs.argv(out, zero=0, flags=["--save", str(blocker / "ckpt")]),
        tmp_path,
        f"--save {blocker / 'ckpt'}: cannot create it",
    )
