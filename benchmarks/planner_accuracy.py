"""How well the planner ranks and predicts: measured step time of real launcher runs against its prediction.

    python benchmarks/planner_accuracy.py --profile cpu.json [--model-config launch/models/tiny-hybrid.json]
        [--seq-length 256] [--global-batch-size 8] [--steps 6] [--runs 3] [--results benchmarks/RESULTS.md]

Each configuration (layout, micro-batch, ZeRO stage, recompute, CP on 1-2 ranks) runs `--runs` times through
`deepspeed launch/train.py` (float32, one thread per rank), in rounds of one run of each, so a machine whose
speed drifts slows every configuration alike; a run's step time is the median over its steps after the first
two (warm-up), a configuration's the median of its runs. The prediction is the planner's
step time for the same plan with `--profile` (write one for this machine with `python launch/plan.py
--calibrate`). Printed: a table per configuration, the Kendall tau of the two rankings, whether the measured
best is in the predicted top 3, the regret of the predicted best (its measured time over the measured
best's, minus 1) and the mean absolute step-time error.
"""

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from megamamba import MambaConfig
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import Request, search

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(REPO, "launch", "train.py")
# (name, world, flags): dp follows from world / (cp x tp x pp)
CONFIGS = [
    ("1 rank, micro 8", 1, {"micro_batch_size": 8, "zero_stage": 0}),
    ("1 rank, micro 2 x 4", 1, {"micro_batch_size": 2, "zero_stage": 0}),
    ("1 rank, micro 8, recompute", 1, {"micro_batch_size": 8, "zero_stage": 0, "recompute": True}),
    ("dp 2, micro 4, ZeRO 1", 2, {"dp": 2, "micro_batch_size": 4, "zero_stage": 1}),
    ("dp 2, micro 1 x 4, ZeRO 1", 2, {"dp": 2, "micro_batch_size": 1, "zero_stage": 1}),
    ("dp 2, micro 4, ZeRO 2", 2, {"dp": 2, "micro_batch_size": 4, "zero_stage": 2}),
    ("dp 2, micro 4, ZeRO 0, recompute", 2, {"dp": 2, "micro_batch_size": 4, "zero_stage": 0, "recompute": True}),
    ("tp 2 + SP, micro 8", 2, {"tp": 2, "micro_batch_size": 8, "zero_stage": 0}),
    ("tp 2 + SP, micro 2 x 4", 2, {"tp": 2, "micro_batch_size": 2, "zero_stage": 0}),
    ("pp 2, micro 2 x 4", 2, {"pp": 2, "micro_batch_size": 2, "zero_stage": 0}),
    ("pp 2, micro 1 x 8", 2, {"pp": 2, "micro_batch_size": 1, "zero_stage": 1}),
    ("cp 2, micro 8", 2, {"cp": 2, "micro_batch_size": 8, "zero_stage": 0}),
    ("cp 2, micro 4 x 2, ZeRO 1", 2, {"cp": 2, "micro_batch_size": 4, "zero_stage": 1}),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="this machine's profile (python launch/plan.py --calibrate)")
    p.add_argument("--model-config", default=os.path.join(REPO, "launch/models/tiny-hybrid.json"))
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--results", default=None, help="append the table to this markdown file")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(fixed: dict, world: int, batch: int) -> tuple:
    tp, pp, cp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("cp", 1)
    dp = world // (tp * pp * cp)
    ds = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": fixed["micro_batch_size"],
        "zero_optimization": {"stage": fixed["zero_stage"]},
        "steps_per_print": 10**6,
    }
    flags = ["--tp", str(tp), "--pp", str(pp), "--cp", str(cp)]
    if tp > 1:
        flags.append("--sequence-parallel")
    if fixed.get("recompute"):
        flags += ["--checkpoint-activations-interval", "1"]
    return {**fixed, "dp": dp, "tp": tp, "pp": pp, "cp": cp, "recompute": bool(fixed.get("recompute"))}, ds, flags


def measure_once(args, world: int, ds: dict, flags: list, folder: str, run: int) -> float:
    """One run's median step time (seconds) after two warm-up steps."""
    ds_path = os.path.join(folder, "ds.json")
    with open(ds_path, "w") as f:
        json.dump(ds, f)
    tokens = args.global_batch_size * args.seq_length
    metrics = os.path.join(folder, f"metrics-{run}.jsonl")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        str(world),
        "--master_port",
        str(_free_port()),
        TRAIN_PY,
        "--deepspeed_config",
        ds_path,
        "--model-config",
        args.model_config,
        "--seq-length",
        str(args.seq_length),
        "--train-iters",
        str(args.steps),
        "--log-interval",
        "1",
        "--metrics-jsonl",
        metrics,
        *flags,
    ]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return statistics.median(tokens / r["tokens_per_s"] for r in records[2:])


def kendall_tau(a: list, b: list) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def predict(args, model: MambaConfig, profile, fixed: dict, world: int) -> float:
    request = Request(
        model,
        world,
        world,
        args.seq_length,
        args.global_batch_size,
        profile.device_memory_bytes,
        autocast=False,
        fixed={k: fixed[k] for k in ("dp", "cp", "tp", "pp", "zero_stage", "micro_batch_size", "recompute")},
    )
    return search(request, profile).plans[0].time.total


def main(argv=None) -> int:
    args = parse_args(argv)
    model, profile = MambaConfig.from_json(args.model_config), load_profile(args.profile)
    times = {name: [] for name, _, _ in CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        for run in range(args.runs):
            for i, (name, world, settings) in enumerate(CONFIGS):
                _, ds, flags = _flags(settings, world, args.global_batch_size)
                folder = os.path.join(root, str(i))
                os.makedirs(folder, exist_ok=True)
                times[name].append(measure_once(args, world, ds, flags, folder, run))
                print(f"round {run + 1}: {name}: {times[name][-1]:.3f} s", flush=True)
    rows = []
    for name, world, settings in CONFIGS:
        fixed = _flags(settings, world, args.global_batch_size)[0]
        rows.append((name, statistics.median(times[name]), predict(args, model, profile, fixed, world)))
        print(f"{name}: measured {rows[-1][1]:.3f} s, predicted {rows[-1][2]:.3f} s", flush=True)
    measured, predicted = [r[1] for r in rows], [r[2] for r in rows]
    best = min(range(len(rows)), key=lambda i: measured[i])
    top3 = sorted(range(len(rows)), key=lambda i: predicted[i])[:3]
    pick = top3[0]
    error = statistics.fmean(abs(p - m) / m for m, p in zip(measured, predicted))
    lines = ["| configuration | measured s | predicted s | error |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {m:.3f} | {p:.3f} | {100 * (p - m) / m:+.0f}% |" for n, m, p in rows]
    lines.append(
        f"\nKendall tau {kendall_tau(measured, predicted):.2f}; measured best ({rows[best][0]}) "
        f"{'in' if best in top3 else 'not in'} the predicted top 3; regret of the predicted best "
        f"({rows[pick][0]}) {100 * (measured[pick] / measured[best] - 1):.0f}%; mean absolute step-time "
        f"error {100 * error:.0f}%"
    )
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
