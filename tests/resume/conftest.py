"""Session fixtures of tests/resume: the run helper (resume_runs.py) and the shared (1,1,1) reference run."""
import pytest

from resume_runs import SAVE_AT, STEPS, Runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("resume_runs"))


@pytest.fixture(scope="session")
def reference(runs):
    """(1,1,1) without ZeRO, 8 steps, one checkpoint every 4 steps: its records and save directory."""
    out = runs.new_dir()
    run = runs.direct(runs.argv(out, zero=0, flags=["--save", str(out / "ckpt"), "--save-interval", str(SAVE_AT)]),
                      out=out)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(STEPS))
    return run
