"""benchmarks/check_memory_plan.py (the GPU check of the activation estimate) runs on the CPU in its dry
mode: one rank builds the engine, takes a step, measures a micro-batch and prints its one JSON line,
leaving no temporary DeepSpeed config behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_prints_the_kept_and_peak_figures(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "MASTER_PORT": str(free_port()), "TMPDIR": str(scratch)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/check_memory_plan.py"), "--dry-run"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["size"] == "tiny" and record["seq"] == 64, record
    for key in ("kept_measured", "kept_estimated", "peak_measured", "peak_estimated", "kept_error", "peak_error"):
        assert isinstance(record[key], (int, float)), (key, record)
    assert list(scratch.glob("*.json")) == [] and list(scratch.glob("*/ds_config.json")) == []
