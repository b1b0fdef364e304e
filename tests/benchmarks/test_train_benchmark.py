"""benchmarks/train.py runs only on a GPU; here: it imports, answers --help, its summaries are right,
and its runs of our engine (one rank, and through the deepspeed launcher) train on a tiny CPU config."""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_entry import ROOT

BENCH = ROOT / "benchmarks/train.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("megamamba_train_benchmark", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_the_options_without_a_gpu():
    proc = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--sizes", "--steps", "--launch-size", "--mamba-ssm-src", "--peak-tflops", "--results"):
        assert flag in proc.stdout


def test_every_size_has_a_model_and_a_deepspeed_config(bench):
    for size in bench.SIZES:
        for path in bench._paths(size):
            assert (ROOT / path).is_file(), path


def test_averages_leave_out_the_warmup_steps_and_keep_the_largest_memory(bench):
    records = [
        {"step": i, "tokens_per_s": t, "tflops_per_device": t / 10, "mfu": t / 1000, "mem_peak_gb": m, "loss": 5.0 - i}
        for i, (t, m) in enumerate([(1.0, 3.0), (100.0, 2.0), (200.0, 2.5)])
    ]
    summary = bench.averaged(records, warmup=1)
    assert summary == pytest.approx(
        {"tokens_per_s": 150.0, "tflops_per_device": 15.0, "mfu": 0.15, "mem_peak_gb": 3.0, "final_loss": 3.0}
    )


def test_the_table_shows_each_run_or_its_failure(bench):
    text = bench.table(
        [
            (
                "130m",
                "ours",
                {"tokens_per_s": 123456.0, "tflops_per_device": 101.25, "mfu": 0.1023, "mem_peak_gb": 12.34},
            ),
            ("1.3b", "mamba_ssm", {"error": "CUDA out of memory"}),
        ]
    )
    lines = text.splitlines()
    assert lines[2] == "| 130m | ours | 123,456 | 101.2 | 10.2% | 12.3 |"
    assert lines[3].startswith("| 1.3b | mamba_ssm | failed:") and "out of memory" in lines[3]


def test_without_a_gpu_it_stops_with_a_message(bench):
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--sizes", "130m"])


def test_mamba_ssm_loads_where_transformers_is_missing(bench, tmp_path, monkeypatch):
    """The GPU machine has no transformers; mamba_ssm 2.3.2's generation and hub helpers import names from it."""
    pkg = tmp_path / "mamba_ssm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "config_mamba.py").write_text("class MambaConfig:\n    pass\n")
    (pkg / "models" / "mixer_seq_simple.py").write_text(
        "from transformers.generation import GenerateDecoderOnlyOutput, TextStreamer\n"
        "from transformers.utils import WEIGHTS_NAME, CONFIG_NAME\n"
        "from transformers.utils.hub import cached_file\n"
        "class MambaLMHeadModel:\n    pass\n"
    )
    (pkg / "ops" / "triton").mkdir(parents=True)
    for module, entry in (
        ("ops/__init__.py", ""),
        ("ops/triton/__init__.py", ""),
        ("ops/selective_scan_interface.py", "def selective_scan_ref(*a):\n    pass\n"),
        ("ops/triton/layer_norm.py", "def rms_norm_fn(*a):\n    pass\n"),
        ("ops/triton/layernorm_gated.py", "def rmsnorm_fn(*a):\n    pass\n"),
        ("ops/triton/ssd_combined.py", "def mamba_chunk_scan_combined(*a):\n    pass\n"),
    ):
        (pkg / module).write_text(entry)
    for name in ("transformers", "transformers.generation", "transformers.utils", "transformers.utils.hub"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as where it is not installed
    for name in ("mamba_ssm", "mamba_ssm.models", "mamba_ssm.models.config_mamba", "mamba_ssm.models.mixer_seq_simple"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    classes, how = bench.load_mamba_ssm(str(tmp_path))
    assert how.startswith("imported"), how
    assert [c.__name__ for c in classes] == ["MambaLMHeadModel", "MambaConfig"]
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_our_runs_write_no_tensorboard_files(bench, tmp_path):
    """The GPU machine has no tensorboard; the configs' tensorboard block is left out of the benchmark's copy."""
    flags = bench._train_flags(*bench._paths("130m"), 3, 2048, 989.0, str(tmp_path / "metrics.jsonl"))
    config = json.loads(Path(flags[flags.index("--deepspeed_config") + 1]).read_text())
    assert "tensorboard" not in config and config["zero_optimization"] == {"stage": 1}
    assert "tensorboard" in json.loads(Path(bench._paths("130m")[0]).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [False, True], ids=["one-rank", "deepspeed-launcher"])
def test_our_runs_train_and_report_throughput(bench, monkeypatch, launcher):
    """run_ours as the GPU benchmark calls it, on the tiny CPU config: one rank started directly,
    or through `deepspeed --num_gpus 1` found on PATH."""
    monkeypatch.setattr(
        bench,
        "_paths",
        lambda size: (str(ROOT / "launch/configs/tiny-cpu.json"), str(ROOT / "launch/models/tiny-mamba2.json")),
    )
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    args = argparse.Namespace(steps=3, warmup=1, seq_length=64, peak_tflops=1.0, launch_steps=2)
    result = bench.run_ours("tiny", args, launcher=launcher)
    assert "error" not in result, result.get("error")
    assert result["tokens_per_s"] > 0 and result["mfu"] == pytest.approx(result["tflops_per_device"])
    assert math.isfinite(result["final_loss"])
