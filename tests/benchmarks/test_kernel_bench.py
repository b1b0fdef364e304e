"""benchmarks/kernel_bench.py (a GPU-only script): the parts that must be right before it ever runs
on a GPU — its layer shapes, FLOP count, mamba_ssm loading and command line — and its correctness
and timing sections run end to end on the CPU with the reference standing in for the kernels."""

import importlib.util
import os
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kernel_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_shapes_follow_the_mamba2_mamba1_and_mamba3_configs(bench):
    shape = bench.mamba2_shape(768)
    assert shape["batch"] * shape["seqlen"] == 16 * 1024
    assert (shape["nheads"], shape["headdim"], shape["dstate"], shape["chunk"]) == (24, 64, 128, 256)
    assert bench.mamba2_shape(2048)["nheads"] == 64
    assert bench.mamba1_shape(768)["dim"] == 1536 and bench.mamba1_shape(768)["dstate"] == 16
    shape = bench.mamba3_shape(2048)
    assert (shape["nheads"], shape["rank"], shape["headdim"], shape["dstate"]) == (64, 1, 64, 128)
    shape = bench.mamba3_shape(2048, mimo=True)  # launch/models/mamba3-1.5b.json
    assert (shape["nheads"], shape["rank"], shape["headdim"], shape["dstate"], shape["chunk"]) == (64, 4, 64, 128, 16)


def test_mamba_ssm_loads_without_its_package_init_when_that_fails(bench, tmp_path, monkeypatch):
    """A release whose __init__ needs a missing dependency still yields the SSD entry point."""
    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import selective_scan_cuda\nimport a_missing_dependency\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(
        "def mamba_chunk_scan_combined(*a, **k):\n    return 'theirs'\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in (
        "mamba_ssm",
        "mamba_ssm.ops",
        "mamba_ssm.ops.triton",
        "mamba_ssm.ops.triton.ssd_combined",
        "selective_scan_cuda",
    ):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fn, how = bench.load_mamba_ssm(str(tmp_path))
    assert fn is not None and fn() == "theirs", how
    assert "without its package __init__" in how
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_mamba_ssm_comparison_is_skipped_without_a_source_path(bench):
    fn, how = bench.load_mamba_ssm(None)
    assert fn is None and "--mamba-ssm-src" in how


def test_help_parses_on_a_machine_without_gpu(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    assert "--mamba-ssm-src" in capsys.readouterr().out


@pytest.fixture
def small_benchmark(bench, monkeypatch):
    """The benchmark on the CPU at small shapes, the PyTorch reference standing in for every kernel
    (and for mamba_ssm), one call per timing: its GPU-only paths run end to end."""
    from megamamba.kernels.reference.ssd import ssd_chunk_scan

    reference = {name: (ref, ref) for name, (_, ref) in bench.ops().items()}
    mamba2_shape, mamba1_shape, mamba3_shape = bench.mamba2_shape, bench.mamba1_shape, bench.mamba3_shape
    monkeypatch.setattr(bench, "ops", lambda: reference)
    monkeypatch.setattr(bench, "load_mamba_ssm", lambda src: (ssd_chunk_scan, "the reference standing in"))
    monkeypatch.setattr(bench, "cuda_time", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "mamba2_shape", lambda d: mamba2_shape(d, tokens=96, seqlen=48))
    monkeypatch.setattr(bench, "mamba1_shape", lambda d: mamba1_shape(d, tokens=96, seqlen=48))
    monkeypatch.setattr(bench, "MAMBA2_D_MODEL", {"tiny": 64})
    monkeypatch.setattr(bench, "mamba3_shape", lambda d, mimo=False: mamba3_shape(d, tokens=96, seqlen=48, mimo=mimo))
    monkeypatch.setattr(bench, "MAMBA1_D_MODEL", {"tiny": 32})
    monkeypatch.setattr(bench, "MAMBA3_D_MODEL", {"tiny": 32})
    monkeypatch.setattr(bench, "TOKENS", 96)
    monkeypatch.setattr(bench, "LONG_SEQLEN", 300)
    monkeypatch.setattr(bench, "CEILING_COPY_BYTES", 2**16)
    monkeypatch.setattr(bench, "CEILING_MATMUL_N", 64)
    return bench


def test_timing_measures_every_op_and_compares_ssd_with_mamba_ssm(small_benchmark):
    rows, how, ceiling = small_benchmark.timing("cpu", "unused")
    assert how == "the reference standing in"
    assert [(r["op"], r["layer"]) for r in rows] == [
        ("ssd_chunk_scan", "mamba2-tiny"),
        ("causal_conv1d", "mamba2-tiny"),
        ("rmsnorm_gated", "mamba2-tiny"),
        ("add_rmsnorm", "mamba2-tiny"),
        ("selective_scan", "mamba1-tiny"),
        ("mamba3_scan", "mamba3-tiny"),
        ("mamba3_scan_inputs", "mamba3-tiny"),
        ("mamba3_scan", "mamba3-tiny-mimo"),
        ("mamba3_scan_inputs", "mamba3-tiny-mimo"),
    ]
    assert rows[0]["vs_mamba_ssm_fwd_bwd"] == 1.0 and rows[0]["vs_reference_fwd_bwd"] == 1.0
    table = small_benchmark.summary([], rows, ceiling)
    assert "ssd_chunk_scan  mamba2-tiny" in table and "1.00" in table


def test_least_work_counts_each_input_output_and_gradient_once(bench):
    gen = torch.Generator().manual_seed(0)
    tensors, kwargs = bench.norm_inputs(10, 6, 6, torch.bfloat16, "cpu", gen)
    out = torch.empty(10, 6, dtype=torch.bfloat16)
    work = bench.least_work("rmsnorm_gated", tensors, kwargs, out)
    x_bytes, w_bytes = 10 * 6 * 2, 6 * 4
    assert work["fwd_bytes"] == 3 * x_bytes + w_bytes  # x, z, weight in; out
    assert work["bwd_bytes"] == 5 * x_bytes + 2 * w_bytes  # x, z, weight, dout in; dx, dz, dweight out
    assert work["fwd_flops"] == work["bwd_flops"] == 0


def test_roofline_fraction_is_the_longer_of_bytes_and_flops_over_the_time(bench):
    ceiling = {"copy_gbps": 1.0, "matmul_tflops": 1.0}  # 1e6 bytes per ms, 1e9 FLOPs per ms
    work = {"fwd_bytes": 2e6, "fwd_flops": 1e9, "bwd_bytes": 1e6, "bwd_flops": 4e9}
    fractions = bench.roofline_fractions(work, fwd_ms=4.0, fwd_bwd_ms=12.0, ceiling=ceiling)
    assert fractions["bwd_ms"] == 8.0
    assert fractions["fwd_roof"] == pytest.approx(2.0 / 4.0) and fractions["bwd_roof"] == pytest.approx(4.0 / 8.0)


@pytest.mark.slow
def test_correctness_check_passes_when_the_kernels_are_the_reference(small_benchmark):
    checks = small_benchmark.correctness("cpu")
    assert len(checks) == 21 and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert {c["dtype"] for c in checks} == {"float32", "bfloat16"}
