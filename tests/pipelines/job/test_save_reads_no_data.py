"""A save reads no training data: the stream record's blend identity (a sampled fingerprint of every
dataset, up to 1024 random reads each on what is often shared storage) is computed once at start-up
and every save reuses it."""

import pytest

from distributed import run_ranks
from train_entry import run_train

pytestmark = pytest.mark.slow


def run_train_counting_fingerprints(argv, extensions_dir) -> int:
    """Run train.py's main on this rank; how many datasets it fingerprinted."""
    from megamamba.data import batches

    original, calls = batches.fingerprint, []

    def counted(dataset, *args, **kwargs):
        calls.append(dataset)
        return original(dataset, *args, **kwargs)

    batches.fingerprint = counted
    try:
        run_train(argv, extensions_dir)
    finally:
        batches.fingerprint = original
    return len(calls)


def test_three_saves_fingerprint_the_one_dataset_once(resume_runs):
    out = resume_runs.new_dir()
    argv = resume_runs.argv(
        out, zero=0, flags=["--train-iters", "3", "--save", str(out / "ckpt"), "--save-interval", "1"]
    )
    (fingerprints,) = run_ranks(
        run_train_counting_fingerprints,
        1,
        args=(argv, resume_runs.extensions_dir),
        init_process_group=False,
        timeout=300,
    )
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]
    assert fingerprints == 1
