"""Training runs for the resume and fault tests: launch/train.py on a tiny Mamba-2, float32, 8 steps.

Three ways to run it: `direct` (one process, `python launch/train.py` with the launcher's
environment), `spawned` (ranks spawned by tests/distributed.py, returning their summaries) and
`launch` (the real `deepspeed` launcher, as a Popen). The model has 4 layers so 4 pipeline
stages get one block each; the global batch (8) does not depend on the layout. The fixtures
`resume_runs` and `resume_reference` serve every test (tests/conftest.py).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port, run_ranks
from run_cache import RunCache, shared_dir
from train_entry import DEEPSPEED, ROOT, TRAIN_PY, rank_zero_of_one, read_metrics, run_train

FAULT_INJECTION_PY = str(ROOT / "tests" / "fault_injection.py")

STEPS, SAVE_AT = 8, 4
COMMON = [
    "--train-iters",
    str(STEPS),
    "--seq-length",
    "32",
    "--log-interval",
    "1",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "1",
    "--seed",
    "1234",
]


def losses(records) -> list:
    return [r["loss"] for r in records]


def snapshot(directory) -> dict:
    """relative path -> sha256 of every file under `directory`."""
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def errors(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("train.py: error:")]


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.extensions_dir = os.environ["TORCH_EXTENSIONS_DIR"]
        self.count = 0

    def new_dir(self) -> Path:
        self.count += 1
        path = self.root / f"run{self.count}"
        path.mkdir()
        return path

    def model_config(self, **changes) -> str:
        config = {**json.loads((ROOT / "launch/models/tiny-mamba2.json").read_text()), "n_layer": 4, **changes}
        path = self.root / f"model-{hashlib.md5(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]}.json"
        path.write_text(json.dumps(config))
        return str(path)

    def ds_config(self, zero: int) -> str:
        path = self.root / f"ds-zero{zero}.json"
        config = json.loads((ROOT / "launch/configs/tiny-cpu.json").read_text())
        path.write_text(json.dumps({**config, "zero_optimization": {"stage": zero}}))
        return str(path)

    def argv(self, out: Path, layout=(1, 1, 1), zero: int = 1, flags=()) -> list:
        _, tp, pp = layout
        return [
            "--deepspeed_config",
            self.ds_config(zero),
            "--model-config",
            self.model_config(),
            "--tensor-parallel-size",
            str(tp),
            "--pipeline-parallel-size",
            str(pp),
            "--metrics-jsonl",
            str(out / "metrics.jsonl"),
            *COMMON,
            *flags,
        ]

    def spawned(self, layout, zero: int, flags=()) -> dict:
        """Rank summaries and directory of a run on dp x tp x pp spawned ranks."""
        out = self.new_dir()
        world = layout[0] * layout[1] * layout[2]
        ranks = run_ranks(
            run_train,
            world,
            args=(self.argv(out, layout, zero, flags), self.extensions_dir),
            init_process_group=False,
            timeout=400,
        )
        return {"ranks": ranks, "records": ranks[0]["records"], "dir": out}

    def env(self, **extra) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": self.extensions_dir, **extra}

    def direct_env(self) -> dict:
        """The environment of `python launch/train.py` as rank 0 of 1."""
        return self.env(**rank_zero_of_one())

    def direct(self, argv, out=None, faults=None) -> dict:
        """`python launch/train.py ARGV` as rank 0 of 1, with `faults` (tests/fault_injection.py's `install`
        keywords) injected: exit code, output, JSONL records."""
        out = out or self.new_dir()
        script = [str(TRAIN_PY)] if faults is None else [FAULT_INJECTION_PY, json.dumps(faults)]
        proc = subprocess.run(
            [sys.executable, *script, *argv],
            cwd=out,
            capture_output=True,
            text=True,
            timeout=300,
            env=self.direct_env(),
        )
        return {
            "returncode": proc.returncode,
            "stdout": proc.stdout,
            "stderr": proc.stderr,
            "records": read_metrics(out / "metrics.jsonl"),
            "dir": out,
        }

    def direct_background(self, argv, out: Path) -> subprocess.Popen:
        """`direct` in the background, its output in out/stdout.txt and out/stderr.txt."""
        return subprocess.Popen(
            [sys.executable, str(TRAIN_PY), *argv],
            cwd=out,
            env=self.direct_env(),
            stdout=open(out / "stdout.txt", "w"),
            stderr=open(out / "stderr.txt", "w"),
        )

    def launch(self, world: int, argv, out: Path) -> subprocess.Popen:
        """The real launcher in the background (its own session, so signals reach it alone)."""
        cmd = [str(DEEPSPEED), "--num_gpus", str(world), "--master_port", str(free_port()), str(TRAIN_PY), *argv]
        return subprocess.Popen(
            cmd,
            cwd=out,
            env=self.env(),
            stdout=open(out / "stdout.txt", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture(scope="session")
def resume_runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("resume_runs"))


@pytest.fixture(scope="session")
def resume_reference(resume_runs, tmp_path_factory):
    """(1,1,1) without ZeRO, 8 steps, one checkpoint every 4 steps: its records and save directory (made
    once for all xdist workers)."""

    def make(out: Path) -> dict:
        argv = resume_runs.argv(out, zero=0, flags=["--save", str(out / "ckpt"), "--save-interval", str(SAVE_AT)])
        return resume_runs.direct(argv, out=out)

    run = RunCache(shared_dir(tmp_path_factory, "resume_reference")).get("resume_reference", make)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == list(range(STEPS))
    return run
