"""Every Triton kernel compiles for the H200 (sm_90), without a GPU: benchmarks/gpu_check/compile_kernels.py
records the launches of every op (forward and backward, float32 and bfloat16, model steps) and
compiles each specialization to a cubin (registers, shared memory and grid checked against the
GPU's limits; no register spills; 16 resident warps per SM for the memory-bound kernels) with the
venv's Triton (benchmarks/gpu_check/gpu_prepare.sh runs the same check with Triton 3.6, the GPU
machine's, before a GPU run). The compile runs in its own process, since interpreted kernels
(TRITON_INTERPRET, set for the rest of the suite) are never compiled."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check", "compile_kernels.py")
TRITON_MODULES = ("ssd", "selective_scan", "conv", "norm", "add_norm", "mamba3_inputs")


def compiler_env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    run = subprocess.run(
        [sys.executable, SCRIPT, "--arch", "90", "--json", str(out)],
        cwd=ROOT,
        env=compiler_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), (
        f"compile_kernels.py wrote no report (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    )
    return json.loads(out.read_text()), run


def defined_kernels():
    """Names of the launchable kernels (`*_kernel`) in megamamba.kernels.triton's modules."""
    import importlib

    names = set()
    for module in TRITON_MODULES:
        namespace = vars(importlib.import_module(f"megamamba.kernels.triton.{module}"))
        names |= {n for n in namespace if n.endswith("_kernel")}
    return names


def test_every_kernel_of_the_triton_ops_is_compiled(report):
    data, _ = report
    assert defined_kernels() - {row["kernel"] for row in data["kernels"]} == set()


def test_every_specialization_compiles_and_fits_an_sm90_block(report):
    data, run = report
    failed = [f"{r['kernel']} ({r['case']}): {r['error']}" for r in data["kernels"] if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert all(r["regs"] > 0 for r in data["kernels"])


def test_no_specialization_spills_registers(report):
    data, _ = report
    spilled = [
        f"{r['kernel']} ({r['case']}, {r['num_warps']} warps): {r['stack_bytes']} B stack at {r['regs']} registers"
        for r in data["kernels"]
        if r["stack_bytes"] > 0
    ]
    assert not spilled, "\n".join(spilled)


# The SSD's tensor-core kernels: compute-bound, their float32 accumulators fill one block per SM.
MATMUL_KERNELS = {"_chunk_state_kernel", "_chunk_scan_kernel", "_dx_kernel", "_dlogdecay_kernel", "_dbc_kernel"}
# Each thread of the selective scan backward holds its chunk's 16 steps of about a dozen float32
# tiles through the reverse scan; capped at 168 or 128 registers it spills (benchmarks/RESULTS.md).
BELOW_16_WARPS = {"_scan_bwd_kernel"}


def test_memory_bound_kernels_keep_16_warps_resident_per_sm(report):
    data, _ = report
    low = [
        f"{r['kernel']} ({r['case']}): {r['regs']} registers x {r['num_warps']} warps -> {r['warps_per_sm']}"
        for r in data["kernels"]
        if r["kernel"] not in MATMUL_KERNELS | BELOW_16_WARPS and r["warps_per_sm"] < 16
    ]
    assert not low, "\n".join(low)


PROBE = textwrap.dedent("""
    import importlib.util, json, sys
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    spec = importlib.util.spec_from_file_location("compile_kernels", {script!r})
    compile_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_kernels)

    @triton.jit
    def square_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        idx = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + idx)
        tl.store(y_ptr + idx, tl.dot(x, x))

    target = GPUTarget("cuda", 90, 32)
    x = torch.zeros(64, 64)
    with compile_kernels.LaunchRecorder(target) as recorder:
        recorder.case = "probe"
        square_kernel[(1,)](x, x, BLOCK={block})
    assert torch.all(x == 0), "the recorder launched the kernel"
    (launch,) = recorder.launches.values()
    print(json.dumps(compile_kernels.compile_launch(launch, target, {limits})))
""")


def probe(tmp_path, block, limits):
    path = tmp_path / "probe.py"
    path.write_text(PROBE.format(script=SCRIPT, block=block, limits=limits))
    run = subprocess.run([sys.executable, str(path)], env=compiler_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_kernel_that_does_not_compile_is_reported(tmp_path):
    row = probe(tmp_path, block=48, limits="compile_kernels.LIMITS[90]")
    assert not row["ok"] and "CompilationError" in row["error"] and "power of 2" in row["error"]


def test_a_kernel_over_the_register_or_shared_memory_limit_is_reported(tmp_path):
    row = probe(tmp_path, block=64, limits="dict(compile_kernels.LIMITS[90], regs_per_block=1024, shared_bytes=1024)")
    assert not row["ok"]
    assert f"{row['regs'] * 128} registers per block > 1024" in row["error"]
    assert f"{row['shared_bytes']} B shared memory > 1024" in row["error"]


def test_occupancy_is_limited_by_registers_shared_memory_or_the_warp_count():
    compile_kernels = load_benchmark("gpu_check/compile_kernels")
    sm90 = compile_kernels.LIMITS[90]
    assert compile_kernels.resident_warps(255, 8, 149_000, sm90) == 8  # registers: one block of 8 warps
    assert compile_kernels.resident_warps(40, 4, 100_000, sm90) == 8  # shared memory: two blocks
    assert compile_kernels.resident_warps(32, 4, 0, sm90) == 64  # the SM's 64 warps
    assert compile_kernels.resident_warps(33, 4, 0, sm90) == 48  # 33 registers are allocated as 40
