"""benchmarks/bf16_errors.py's plumbing: a row for every output and input gradient of every op and for
every parameter group of the model, ratios and tables; with our reference standing in for both
sides (but torch's conv1d for theirs) they agree exactly. The script itself, on a real Triton
kernel and mamba_ssm's, in the slow tier."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark_scripts import load_benchmark
from megamamba.testing.mamba_ssm_release import stand_in

ROOT = Path(__file__).resolve().parents[2]
bf16_errors = load_benchmark("bf16_errors")

QUANTITIES = {
    "ssd_chunk_scan": ["y", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias"],
    "selective_scan": ["out", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"],
    "causal_conv1d": ["out", "dx", "dweight", "dbias"],
    "rmsnorm_gated": ["out", "dx", "dweight", "dz"],
    "add_rmsnorm": ["out", "residual", "dx", "dresidual", "dweight"],
}


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")


def test_every_op_and_quantity_has_a_row_and_the_reference_matches_itself(reference_kernels):
    rows = bf16_errors.op_rows(torch.device("cpu"), stand_in(), seqlens=[64])
    for op, names in QUANTITIES.items():
        mine = [r for r in rows if r["op"] == op]
        assert [r["quantity"] for r in mine] == names
        assert all(r["seqlen"] == 64 and 0 < r["ours"] < 2e-2 for r in mine), mine
        assert op == "causal_conv1d" or all(r["ratio"] == 1.0 for r in mine), mine  # theirs: torch's conv1d
    table = "\n".join(bf16_errors.op_tables(rows))
    assert "| 64 | ours |" in table and "| | ours/theirs | 1.00 |" in table.replace("|  |", "| |")


@pytest.mark.slow
def test_the_model_rows_cover_the_loss_and_every_parameter_group(reference_kernels):
    rows = bf16_errors.model_rows(torch.device("cpu"), stand_in(), backend="reference")
    assert [r["quantity"] for r in rows] == ["loss", "logits", *bf16_errors.GROUPS]
    assert all(0 < r["ours"] < 5e-2 and r["ratio"] == 1.0 for r in rows), rows
    assert "| A_log |" in "\n".join(bf16_errors.model_table(rows))


@pytest.mark.slow
def test_the_script_runs_a_triton_kernel_beside_mamba_ssms_and_writes_json(tmp_path):
    import mamba_ssm_source

    if not mamba_ssm_source.present():
        pytest.skip("mamba_ssm's source release is absent (scripts/setup.sh fetches it)")
    path = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "MEGAMAMBA_KERNELS"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bf16_errors.py"),
            "ops",
            "--ops",
            "rmsnorm_gated",
            "--seqlens",
            "128",
            "--json",
            str(path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(path.read_text())["ops"]
    assert [r["quantity"] for r in rows] == QUANTITIES["rmsnorm_gated"]
    assert all(math.isfinite(r["ours"]) and r["theirs"] and r["ratio"] < 2 for r in rows), rows
    assert "rmsnorm_gated (theirs: layernorm_gated.rmsnorm_fn (Triton))" in proc.stdout
