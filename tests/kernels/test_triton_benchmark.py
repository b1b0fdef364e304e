"""benchmarks/kernels.py (a GPU-only script): the parts that must be right before it ever runs
on a GPU — its layer shapes, FLOP count, mamba_ssm loading and command line."""
import importlib.util
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kernels.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_shapes_follow_the_mamba2_and_mamba1_configs(bench):
    shape = bench.mamba2_shape(768)
    assert shape["batch"] * shape["seqlen"] == 16 * 1024
    assert (shape["nheads"], shape["headdim"], shape["dstate"], shape["chunk"]) == (24, 64, 128, 256)
    assert bench.mamba2_shape(2048)["nheads"] == 64
    assert bench.mamba1_shape(768)["dim"] == 1536 and bench.mamba1_shape(768)["dstate"] == 16


def test_ssd_flops_equal_the_matmuls_of_the_dense_chunked_algorithm(bench):
    b, L, h, p, g, n, q = 2, 64, 4, 8, 2, 16, 16
    c = L // q
    x = torch.randn(b, c, q, g, h // g, p)
    B, C = torch.randn(b, c, q, g, n), torch.randn(b, c, q, g, n)
    with FlopCounterMode(display=False) as counter:
        cb = torch.einsum("bclgn,bcsgn->bcgls", C, B)
        torch.einsum("bcgls,bcsgrp->bclgrp", cb, x)
        states = torch.einsum("bcsgrp,bcsgn->bcgrpn", x, B)
        torch.einsum("bclgn,bcgrpn->bclgrp", C, states)
    assert bench.ssd_flops(b, L, h, p, g, n, q) == counter.get_total_flops()


def test_mamba_ssm_loads_without_its_package_init_when_that_fails(bench, tmp_path, monkeypatch):
    """A release whose __init__ needs a missing dependency still yields the SSD entry point."""
    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import selective_scan_cuda\nimport a_missing_dependency\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text("def mamba_chunk_scan_combined(*a, **k):\n    return 'theirs'\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined",
                 "selective_scan_cuda"):
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
