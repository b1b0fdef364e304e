"""The GPU check (benchmarks/gpu_check/gpu_check.sh) run end to end on the CPU in its dry mode: it installs the
package, runs every section from outside the checkout and each section writes its JSONL records (the
last one a planner profile), leaving no temporary DeepSpeed config behind, so a GPU session is never the
driver's first run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SIZES = ("130m", "370m", "1.3b")
THEIRS_TOO = ("ssd_chunk_scan", "selective_scan", "causal_conv1d", "rmsnorm_gated")  # mamba_ssm's error beside ours
OURS_ALONE = ("mamba3_scan", "mamba3_scan_inputs")


@pytest.mark.slow
def test_dry_run_writes_every_sections_records(tmp_path):
    out, work, scratch = tmp_path / "out", tmp_path / "work", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check/gpu_check.sh"), "--dry-run"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    kinds = {}
    for r in records:
        kinds.setdefault((r["section"], r["kind"]), []).append(r)
    sections = {r["name"]: r for r in kinds[("check", "section")]}
    assert list(sections) == [
        "imports",
        "nccl_smoke",
        "errors",
        "timings",
        *(f"throughput:{s}" for s in SIZES),
        "parity",
        "profile:1.3b",
        "memory_plan:130m",
        "memory_plan:1.3b",
        "planner_profile",
    ]
    repeated = ["throughput:370m", "throughput:1.3b", "memory_plan:1.3b"]  # every size is the tiny model
    assert all(sections[name]["skipped"].startswith("dry run") for name in repeated), sections
    assert all(r["rc"] == 0 and not r["timed_out"] for name, r in sections.items() if name not in repeated), sections
    imports = kinds[("imports", "import")]
    assert len(imports) == 9 and all(r["ok"] and r["file"].startswith(str(work / "site")) for r in imports), imports
    assert [r["run"] for r in kinds[("nccl_smoke", "smoke_run")]] == ["first", "resumed"]
    resume = kinds[("nccl_smoke", "resume")][0]
    assert resume["ok"] and resume["first_step"] == 3 and resume["max_rel_loss_diff"] == 0.0, resume
    errors = kinds[("errors", "error")]
    assert {(r["op"], r["dtype"]) for r in errors} == {
        (op, dt) for op in (*THEIRS_TOO, *OURS_ALONE) for dt in ("float32", "bfloat16")
    }
    assert all(r["ours"] < 1e-2 and (r["theirs"] is None) == (r["op"] in OURS_ALONE) for r in errors)
    assert not kinds.get(("errors", "bf16_failed")), kinds.get(("errors", "bf16_failed"))
    bf16_ops = {r["op"] for r in kinds[("errors", "bf16_error")]}
    assert bf16_ops == {"ssd_chunk_scan", "selective_scan", "causal_conv1d", "rmsnorm_gated", "add_rmsnorm"}, bf16_ops
    model = {r["quantity"] for r in kinds[("errors", "bf16_model")]}
    assert {"loss", "A_log", "dt_bias", "D", "in_proj", "out_proj"} <= model, model
    timings = kinds[("timings", "timing")]
    assert [r["impl"].split(":")[0] for r in timings] == ["ours", "mamba_ssm"] * 3 + ["ours"] * 6
    assert all(0 < r["fwd_roof"] and 0 < r["bwd_roof"] and r["fwd_bytes"] > 0 for r in timings)
    assert kinds[("timings", "ceilings")][0]["copy_gbps"] > 0
    engines = [r["engine"] for r in kinds[("throughput:130m", "throughput")]]
    assert len(engines) == 2 and engines[0].startswith("ours") and engines[1].startswith("mamba_ssm"), engines
    assert all("error" not in r for r in kinds[("throughput:130m", "throughput")])
    assert kinds[("throughput:130m", "throughput")][0]["planned_total_gb"] > 0
    memory_plan = kinds[("memory_plan:130m", "memory_plan")]
    assert [(r["size"], r["seq"]) for r in memory_plan] == [("tiny", 64)]
    for key in ("kept_measured", "kept_estimated", "peak_measured", "peak_estimated", "kept_error", "peak_error"):
        assert isinstance(memory_plan[0][key], (int, float)), (key, memory_plan)
    assert list(scratch.glob("*.json")) == [] and list(scratch.glob("*/ds_config.json")) == []  # no config left
    assert len(kinds[("parity", "parity_step")]) == 3 and kinds[("parity", "parity")][0]["rel_diff"] == 0.0
    step = kinds[("profile:1.3b", "profile")][0]
    ops = kinds[("profile:1.3b", "profile_op")]
    assert len(ops) == 20 and step["self_total_ms"] > 0 and 0 < sum(o["share"] for o in ops) <= 1 + 1e-9, (step, ops)
    assert "Self CPU" in Path(step["table"]).read_text()
    profile = kinds[("planner_profile", "planner_profile")][0]
    assert set(profile["engine"]) == {"0", "1", "2"} and profile["matmul_tflops"] > 0, profile
    assert json.loads((out / "planner_profile.json").read_text())["source"].startswith("measured")
    assert kinds[("check", "triton_cache")]
    for name in ("imports", "errors", "nccl_smoke_first", "nccl_smoke_resumed", "throughput_130m_ours", "parity"):
        assert (out / f"{name}.log").stat().st_size > 0, name
    assert "== GPU check summary" in proc.stdout and "relative difference 0.00%" in proc.stdout
    assert not (out / "site").exists() and (work / "nccl_smoke" / "ckpt").is_dir()  # bulk stays out of OUT
