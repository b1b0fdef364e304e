"""The float32 training run every multi-node test compares against, and its arguments.

Layout (dp, tp, pp) = (1, 2, 2) on 4 ranks: tensor groups {0, 1} and {2, 3}, pipeline stage 0
on ranks 0-1 and stage 1 on ranks 2-3, so on two nodes of two slots the tensor groups stay
inside the nodes and the pipeline boundary crosses them. `reference_records()` is the same
layout on one node (`deepspeed --num_gpus 4`), run once per test session and shared.
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

from distributed import free_port
from harness import launcher_env
from train_entry import DEEPSPEED, ROOT, TRAIN_PY, read_metrics

TP, PP = 2, 2
WORLD = 4


def train_args(out: Path, train_iters: int = 5, extra: tuple = ()) -> list:
    """launch/train.py's arguments: tiny Mamba-2, float32 (the JSON has no bf16 block), metrics to out/."""
    return [
        "--deepspeed_config",
        ROOT / "launch/configs/tiny-cpu.json",
        "--model-config",
        ROOT / "launch/models/tiny-mamba2.json",
        "--tensor-parallel-size",
        TP,
        "--pipeline-parallel-size",
        PP,
        "--train-iters",
        train_iters,
        "--seq-length",
        32,
        "--log-interval",
        1,
        "--lr",
        1e-3,
        "--min-lr",
        1e-4,
        "--lr-warmup-iters",
        1,
        "--seed",
        1234,
        "--metrics-jsonl",
        out / "metrics.jsonl",
        *extra,
    ]


def curve(records: list) -> list:
    """(step, loss, grad_norm) per logged step."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


@functools.lru_cache(maxsize=None)
def reference_records() -> tuple:
    """The one-node, 4-process run of the same layout: its metrics records."""
    out = Path(tempfile.mkdtemp(prefix="multinode_reference_"))
    cmd = [
        str(DEEPSPEED),
        "--num_gpus",
        str(WORLD),
        "--master_port",
        str(free_port()),
        str(TRAIN_PY),
        *map(str, train_args(out)),
    ]
    proc = subprocess.run(cmd, cwd=out, env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(5)), records
    return tuple(records)


def assert_same_curve(records: list, what: str) -> None:
    """Bit-identical loss and gradient norm at every step, against the one-node run."""
    reference = curve(reference_records())
    got = curve(records)
    worst = max((abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, reference)), default=float("nan"))
    print(f"{what}: {len(got)} steps, max relative loss difference to the 1-node run {worst:.1e}")
    assert got == reference, f"{what}: {got} != 1-node {reference}"
