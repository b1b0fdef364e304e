"""The save directory: complete checkpoints, `latest`, retention, and saves interrupted at every step.

A save changes the disk only through megamamba.checkpoint.files (write_file, write_tensors,
sync_dir, rename, remove_tree). The crash tests interrupt the N-th of those calls, for every N
of a save, either before it runs or, for writes, after writing only half of the file (a torn
write), and check what a restarted job would see: a complete checkpoint holding exactly what
was saved under its tag, and, after it saves again, a clean directory. They stub os.fsync, whose
effect no test without a power cut can observe (hundreds of real ones cost seconds on a busy
disk); test_checkpoint_kill.py runs saves with the real one.
"""

import functools
import os
import warnings

import pytest
import torch

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from megamamba.checkpoint import (
    Checkpoint,
    CheckpointWarning,
    files,
    find_latest,
    model_tensors,
    save_checkpoint,
)
from megamamba.checkpoint.manifest import verify

CONFIG = tiny("Mamba2")
PRIMITIVES = ("write_file", "write_tensors", "sync_dir", "rename", "remove_tree")
WRITES = ("write_file", "write_tensors")


@functools.lru_cache(maxsize=None)
def weights(seed: int) -> dict:
    return model_tensors(perturbed_model(CONFIG, seed))


def save(save_dir, step: int, keep_last=None, seed=None) -> str:
    return save_checkpoint(
        str(save_dir),
        step,
        CONFIG,
        weights(step if seed is None else seed),
        keep_last=keep_last,
        extra={"note": f"step {step}"},
    )


def holds_weights_of(path: str, seed: int) -> bool:
    loaded = Checkpoint(path).model_tensors()
    expected = weights(seed)
    return loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_save_writes_a_complete_checkpoint_and_points_latest_at_it(tmp_path):
    path = save(tmp_path, 7)
    assert path == str(tmp_path / "step_000007")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000007"]
    assert (tmp_path / "latest").read_text() == "step_000007\n"
    assert sorted(verify(path)["files"]) == [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng-rank-00000.safetensors",
        "trainer_state.json",
    ]
    ckpt = Checkpoint(path)
    assert (ckpt.step, ckpt.tag, ckpt.extra) == (7, "step_000007", {"note": "step 7"})
    assert holds_weights_of(path, 7)


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000004", "step_000005"]
    assert find_latest(str(tmp_path)) == str(tmp_path / "step_000005")


def test_keep_last_must_be_a_positive_integer_and_is_checked_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"keep_last=0: must be a positive integer or None"):
        save(tmp_path, 1, keep_last=0)
    assert not os.path.exists(tmp_path / "step_000001") and os.listdir(tmp_path) == []


def test_find_latest_takes_the_checkpoint_latest_names_over_a_newer_one_of_an_abandoned_run(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 9)  # an abandoned continuation...
    save(tmp_path, 3)  # ...after which a resumed run saved step 3
    assert find_latest(str(tmp_path)) == str(tmp_path / "step_000003")


def test_find_latest_passes_over_a_damaged_latest_with_a_warning(tmp_path):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    with open(os.path.join(newest, "model.safetensors"), "r+b") as f:
        f.truncate(100)
    with pytest.warns(CheckpointWarning, match=r"names step_000002, which is unusable: .*truncated"):
        assert find_latest(str(tmp_path)) == str(tmp_path / "step_000001")


def test_find_latest_without_latest_warns_and_takes_the_newest_complete_checkpoint(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    os.remove(tmp_path / "latest")
    with pytest.warns(
        CheckpointWarning,
        match=r"latest is missing; resuming from the newest complete checkpoint "
        r"step_000002",
    ):
        assert find_latest(str(tmp_path)) == str(tmp_path / "step_000002")


def test_a_checkpoint_without_manifest_is_incomplete(tmp_path):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    os.remove(os.path.join(newest, "manifest.json"))
    with pytest.warns(CheckpointWarning, match=r"incomplete checkpoint, no manifest.json"):
        assert find_latest(str(tmp_path)) == str(tmp_path / "step_000001")


def test_saving_an_existing_tag_replaces_it(tmp_path):
    save(tmp_path, 4)
    path = save(tmp_path, 4, seed=40)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000004"]
    assert holds_weights_of(path, 40)


class Crash(Exception):
    """Stands for the process dying at this point."""


def interrupt(monkeypatch, at: int, torn: bool) -> list:
    """Make the `at`-th file primitive call (1-based) crash, after writing half of it when `torn`; returns the log."""
    log = []
    for name in PRIMITIVES:
        original = getattr(files, name)

        def primitive(*args, _name=name, _original=original, **kwargs):
            log.append(_name)
            if len(log) != at:
                return _original(*args, **kwargs)
            if torn and _name in WRITES:
                _original(*args, **kwargs)
                with open(args[0], "r+b") as f:
                    f.truncate(os.path.getsize(args[0]) // 2)
            raise Crash(f"{_name} #{at}")

        monkeypatch.setattr(files, name, primitive)
    return log


# name: (saves before, the interrupted save, keep_last, what each tag may hold afterwards (weight seeds))
SCENARIOS = {
    "new": ([(1, 1)], (2, 2), 1, {"step_000001": {1}, "step_000002": {2}}),
    "replace": ([(1, 1), (2, 20)], (2, 2), 2, {"step_000001": {1}, "step_000002": {20, 2}}),
}


def primitive_calls(tmp_path, monkeypatch, scenario: str) -> list:
    before, (step, seed), keep_last, _ = SCENARIOS[scenario]
    for s, w in before:
        save(tmp_path / "count", s, keep_last, seed=w)
    with monkeypatch.context() as m:
        log = interrupt(m, at=0, torn=False)
        save(tmp_path / "count", step, keep_last, seed=seed)
    return log


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("torn", [False, True], ids=["before", "torn"])
def test_a_save_interrupted_at_any_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, torn, scenario):
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    before, (step, seed), keep_last, _ = SCENARIOS[scenario]
    calls = primitive_calls(tmp_path, monkeypatch, scenario)
    assert calls.count("rename") >= 2 and "remove_tree" in calls, calls
    for at in range(1, len(calls) + 1):
        if torn and calls[at - 1] not in WRITES:
            continue  # tearing applies to writes; the other calls are interrupted in the "before" run
        save_dir = tmp_path / f"crash{at}"
        for s, w in before:
            save(save_dir, s, keep_last, seed=w)
        with monkeypatch.context() as m:
            interrupt(m, at, torn)
            with pytest.raises(Crash):
                save(save_dir, step, keep_last, seed=seed)

        assert_recovers(save_dir, scenario, f"interrupted at call {at} ({calls[at - 1]}) of {calls}")


def assert_recovers(save_dir, scenario: str, where: str) -> None:
    """After an interrupted save: what a restarted job finds is complete and holds what was saved under its
    tag; saving again succeeds and leaves exactly the checkpoints keep_last allows."""
    _, (step, seed), keep_last, allowed = SCENARIOS[scenario]
    latest = (save_dir / "latest").read_text().strip()
    if os.path.isdir(save_dir / latest):
        verify(str(save_dir / latest))  # `latest` never names an incomplete checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # replacing a tag: `latest` may name a moved one
        found = find_latest(str(save_dir))
    assert any(holds_weights_of(found, w) for w in allowed[os.path.basename(found)]), where

    save(save_dir, step, keep_last, seed=seed)
    assert sorted(os.listdir(save_dir)) == ["latest", *sorted(allowed)[-keep_last:]], where
    assert holds_weights_of(find_latest(str(save_dir)), seed), where


def test_nothing_changes_when_the_model_tensors_do_not_fit_the_config(tmp_path):
    save(tmp_path, 1)
    before = snapshot(str(tmp_path))
    bad = {**weights(2), "backbone.layers.0.mixer.D": torch.ones(5)}  # a copy: weights() is cached
    with pytest.raises(
        files.CheckpointError,
        match=r"backbone.layers.0.mixer.D has shape \(5,\), the model config "
        r"implies \(6,\)",
    ):
        save_checkpoint(str(tmp_path), 2, CONFIG, bad)
    assert snapshot(str(tmp_path)) == before
