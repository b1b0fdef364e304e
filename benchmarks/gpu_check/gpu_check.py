"""The GPU check's driver: every section in its own child process with a timeout, in this order,
within one time budget, each measurement appended to <out>/results.jsonl as it is made.

    python benchmarks/gpu_check/gpu_check.py --out DIR [--work DIR] [--site DIR] [--mamba-ssm-src DIR]
        [--triton-cache ARCHIVE] [--budget 450] [--dry-run]
        [--only imports errors ...]        (run by gpu_check.sh, which installs the package)
    python benchmarks/gpu_check/gpu_check.py --out DIR --summary    (the tables of what a run wrote so far)

imports      every megamamba subpackage, from --site (the installed copy) and not from the checkout;
             versions of python, torch, Triton, DeepSpeed, CUDA and the GPU
nccl_smoke   `deepspeed --num_gpus 1 launch/train.py` with a save and a resume (check_train.py)
errors       each op's fp32 and bf16 error against float64, ours next to mamba_ssm's, and the bf16
             comparison per seqlen and of a small LM (check_ops.py, bf16_errors.py)
timings      op timings against the roofline measured in the same run, ours and mamba_ssm's
             interleaved per shape (check_ops.py)
throughput:* training tokens/s at 130m, 370m, 1.3b, ours then mamba_ssm's (check_train.py)
parity       losses of ours and mamba_ssm over 20 bf16 steps from the same weights and batches
profile:1.3b one training step of our 1.3b model under torch.profiler: operators by device time (check_profile.py)
memory_plan:* the start-up memory plan's activation estimate against one measured micro-batch
             (kept for the backward, and the peak) at 130m and 1.3b (check_memory_plan.py)
planner_profile  `launch/plan.py --calibrate` at mamba2-130m's shapes: this GPU's planner profile,
             <out>/planner_profile.json (one GPU: the links are launch/profiles/h200.json's)
A section past its timeout is stopped (SIGTERM, then SIGKILL) and the next one runs; a section
that no longer fits the budget is skipped with a record saying so. Each child's output streams to
<out>/<section>.log. --dry-run: the CPU, our PyTorch reference for the kernels and for mamba_ssm,
tiny shapes and models, gloo: every section's code path and records, no GPU; a section of a size
runs once (every size is the tiny model there), the others are recorded as skipped.
"""

import argparse
import json
import os
import sys
import tempfile
import time

from check_io import (
    COMPILES,
    Results,
    count_triton_compiles,
    load_benchmark,
    read_results,
    unpack_triton_cache,
)
from megamamba.testing.processes import run_logged, stop_children_on_sigterm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (section, seconds at most); the budget may cut a later one shorter.
SECTIONS = [
    ("imports", 60),
    ("nccl_smoke", 100),
    ("errors", 120),
    ("timings", 75),
    ("throughput:130m", 70),
    ("throughput:370m", 70),
    ("throughput:1.3b", 110),
    ("parity", 60),
    ("profile:1.3b", 60),
    ("memory_plan:130m", 45),
    ("memory_plan:1.3b", 60),
    ("planner_profile", 90),
]
PACKAGES = [
    "megamamba",
    "megamamba.kernels",
    "megamamba.kernels.reference",
    "megamamba.kernels.triton",
    "megamamba.pipelines",
    "megamamba.parallel",
    "megamamba.checkpoint",
    "megamamba.data",
    "megamamba.tokenizer",
]
MIN_SECONDS = 15  # a section given less than this is skipped
DRY_SCALE = 4  # the dry run's caps: a shared 2-core CPU starts DeepSpeed far slower than the GPU machine


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="output folder: results.jsonl, one log per section")
    p.add_argument("--work", default=None, help="scratch folder for checkpoints (default: a new temporary one)")
    p.add_argument("--site", default=None, help="where the package was installed (the imports section checks it)")
    p.add_argument(
        "--triton-cache",
        default=None,
        help="Triton cache archive (benchmarks/gpu_check/triton_cache.py) to unpack under --work and use",
    )
    p.add_argument("--cache-identity", default=None, help=argparse.SUPPRESS)  # the archive's key inputs
    p.add_argument("--mamba-ssm-src", default=None, help="unpacked mamba_ssm source release (holding mamba_ssm/)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all sections together")
    p.add_argument("--dry-run", action="store_true", help="CPU, reference kernels, tiny shapes, no mamba_ssm")
    p.add_argument("--only", nargs="+", default=None, metavar="SECTION", help="run these sections only")
    p.add_argument("--summary", action="store_true", help="print the tables of <out>/results.jsonl and exit")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child runs one section
    p.add_argument("--timeout", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [name for name, _ in SECTIONS]
    for name in args.only or []:
        if name not in names:
            p.error(f"--only {name}: no such section (sections: {', '.join(names)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.summary:
        print(summary(args.out))
        return 0
    if args.section:
        return run_section(args)
    args.work = args.work or tempfile.mkdtemp(prefix="gpu_check_")
    results = Results(args.out, "check")
    start = time.time()
    if args.triton_cache:
        os.environ["TRITON_CACHE_DIR"] = os.path.join(args.work, "triton-cache")
        unpack_triton_cache(args.triton_cache, os.environ["TRITON_CACHE_DIR"])
        identity = args.triton_cache[: -len(".tar.gz")] + ".json"
        args.cache_identity = identity if os.path.exists(identity) else None
    cache = os.environ.get("TRITON_CACHE_DIR")
    shipped = cache_entries(cache)
    results.write(
        "start", dry_run=args.dry_run, budget_s=args.budget, triton_cache_dir=cache, triton_cache_entries=len(shipped)
    )
    failed, ran = 0, set()
    for name, cap in SECTIONS:
        if args.only and name not in args.only:
            continue
        kind = name.split(":")[0]
        if args.dry_run and kind in ran:
            results.write("section", name=name, rc=None, skipped="dry run: every size is the tiny model, run once")
            continue
        ran.add(kind)
        left = args.budget - (time.time() - start)
        timeout = min(cap * (DRY_SCALE if args.dry_run else 1), left)
        if timeout < MIN_SECONDS:
            results.write("section", name=name, rc=None, skipped=f"{left:.0f} s of the budget left")
            failed += 1
            continue
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--section",
            name,
            "--out",
            args.out,
            "--work",
            args.work,
            "--timeout",
            str(timeout),
        ] + (["--dry-run"] if args.dry_run else [])
        cmd += ["--site", args.site] if args.site else []
        cmd += ["--cache-identity", args.cache_identity] if args.cache_identity else []
        cmd += ["--mamba-ssm-src", args.mamba_ssm_src] if args.mamba_ssm_src else []
        status = run_logged(
            cmd, os.path.join(args.out, name.replace(":", "_") + ".log"), timeout, env=section_env(args.dry_run)
        )
        results.write("section", name=name, **status)
        failed += status["rc"] != 0
    now = cache_entries(cache)
    results.write(
        "triton_cache",
        dir=cache,
        shipped=len(shipped),
        compiled_anew=len(now - shipped),
        total_s=round(time.time() - start, 1),
    )
    print(summary(args.out), flush=True)
    return 1 if failed else 0


def section_env(dry: bool) -> dict:
    """A child's environment: the dry run forces the reference kernels on the CPU, and pins the
    launcher's ranks to it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry:
        env.update(MEGAMAMBA_KERNELS="reference", CUDA_VISIBLE_DEVICES="")
    return env


def cache_entries(cache) -> set:
    """The kernel entries (one folder per compiled kernel) of a Triton cache folder."""
    return set(os.listdir(cache)) if cache and os.path.isdir(cache) else set()


def run_section(args) -> int:
    """One section, in this (child) process."""
    stop_children_on_sigterm()
    import torch

    results = Results(args.out, args.section)
    count_triton_compiles(args.out, args.section)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        results.write("section_failed", error="no CUDA device (use --dry-run on a CPU)")
        return 1
    name, _, size = args.section.partition(":")
    if name == "imports":
        if args.cache_identity:
            compare_cache_identity(results, args.cache_identity)
        return imports(results, args.site)
    if name == "nccl_smoke":
        from check_train import nccl_smoke

        nccl_smoke(results, args.out, args.work, args.dry_run, args.timeout or 100)
        return 0
    if name == "memory_plan":
        from check_memory_plan import check

        results.write("memory_plan", **check(size, 0, args.dry_run))
        return 0
    if name == "profile":
        from check_profile import profile_step

        profile_step(results, args.out, size, args.dry_run)
        return 0
    if name == "planner_profile":
        planner_profile(results, args.out, args.dry_run, args.timeout or 90)
        return 0
    theirs = mamba_ssm(results, args)
    if name in ("errors", "timings"):
        import check_ops
        from megamamba.testing.mamba_ssm_release import stand_in

        ops = stand_in() if args.dry_run else theirs
        (check_ops.errors if name == "errors" else check_ops.timings)(results, device, ops, args.dry_run)
        return 0
    import check_train
    from megamamba.testing.mamba_ssm_release import stand_in

    models = stand_in() if args.dry_run else theirs
    if name == "throughput":
        check_train.throughput(results, args.out, size, args.dry_run, models, args.timeout or 90)
    elif models is not None:
        check_train.parity(results, args.dry_run, models)
    else:
        results.write("parity_failed", error="mamba_ssm not loaded (see its record)")
    return 0


def planner_profile(results, out: str, dry: bool, timeout: float) -> None:
    """This machine's planner profile (`launch/plan.py --calibrate`), written to <out>/planner_profile.json."""
    path = os.path.join(out, "planner_profile.json")
    model, seq, micro = ("tiny-mamba2.json", 64, 1) if dry else ("mamba2-130m.json", 2048, 4)
    cmd = [
        sys.executable,
        os.path.join(REPO, "launch/plan.py"),
        "--calibrate",
        "--out",
        path,
        "--ranks",
        "1",
        "--model-config",
        os.path.join(REPO, "launch/models", model),
        "--seq-length",
        str(seq),
        "--micro-batch-size",
        str(micro),
        "--profile",
        os.path.join(REPO, "launch/profiles/h200.json"),
    ]
    status = run_logged(cmd, os.path.join(out, "planner_profile_calibrate.log"), timeout - 5)
    if status["rc"] != 0 or not os.path.exists(path):
        results.write("planner_profile_failed", **status)
        return
    with open(path) as f:
        profile = json.load(f)
    results.write(
        "planner_profile",
        file=path,
        name=profile["name"],
        seconds=status["seconds"],
        matmul_tflops=profile["matmul_flops_per_s"] / 1e12,
        copy_gbps=profile["copy_bytes_per_s"] / 1e9,
        engine=profile["engine"],
        layers=profile["layers"],
    )


def mamba_ssm(results, args):
    """mamba_ssm's entry points, or None (the reason recorded); never loaded in the dry run."""
    if args.dry_run:
        results.write("mamba_ssm", loaded=False, how="dry run: our reference stands in")
        return None
    from megamamba.testing.mamba_ssm_release import load

    theirs, how = load(args.mamba_ssm_src)
    results.write("mamba_ssm", loaded=theirs is not None, how=how)
    return theirs


def imports(results, site) -> int:
    """Import every subpackage; each must come from `site` (the installed copy), not the checkout."""
    import importlib

    bad = 0
    for name in PACKAGES:
        try:
            path = importlib.import_module(name).__file__
        except Exception as exc:  # noqa: BLE001 - every package is tried and reported
            results.write("import", package=name, ok=False, error=repr(exc)[:300])
            bad += 1
            continue
        ok = not path.startswith(REPO + os.sep) and (
            site is None or path.startswith(os.path.realpath(site) + os.sep) or path.startswith(site + os.sep)
        )
        results.write("import", package=name, ok=ok, file=path)
        bad += not ok
    results.write("versions", **versions())
    return 1 if bad else 0


def compare_cache_identity(results, path) -> None:
    """Whether the shipped Triton cache was made with the key inputs this machine has."""
    from check_io import triton_cache_identity

    with open(path) as f:
        shipped = json.load(f)
    try:
        here = triton_cache_identity()
    except Exception as exc:  # noqa: BLE001 - e.g. another Triton's internals
        results.write("triton_identity", match=False, error=repr(exc)[:300], shipped=shipped)
        return
    results.write("triton_identity", match=here == shipped, here=here, shipped=shipped)


def versions() -> dict:
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for module in ("triton", "deepspeed"):
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:  # noqa: BLE001
            info[module] = f"not importable: {exc!r:.100}"
    return info


# ----------------------------------------------------------------------------- summary


def summary(out: str) -> str:
    """The tables of <out>/results.jsonl: what each section measured, as far as it got."""
    records = read_results(out)
    by_kind = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    lines = ["", "== GPU check summary (" + os.path.join(out, "results.jsonl") + ")"]
    for r in by_kind.get("versions", []):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("section", "kind", "t")))
    for r in by_kind.get("section", []):
        state = (
            r.get("skipped")
            and f"skipped ({r['skipped']})"
            or ("TIMED OUT" if r.get("timed_out") else ("ok" if r["rc"] == 0 else f"FAILED (exit {r['rc']})"))
        )
        lines.append(f"section {r['name']:16s} {state:24s} {r.get('seconds', '')} s")
    bad_imports = [r["package"] for r in by_kind.get("import", []) if not r["ok"]]
    if by_kind.get("import"):
        lines.append(
            f"imports: {len(by_kind['import']) - len(bad_imports)}/{len(by_kind['import'])} from the "
            f"installed copy" + (f"; wrong or failing: {', '.join(bad_imports)}" if bad_imports else "")
        )
    for r in by_kind.get("smoke_run", []):
        lines.append(f"nccl smoke {r['run']:8s} exit {r['rc']} in {r['seconds']} s, steps {r['steps']}")
    for r in by_kind.get("resume", []):
        details = {k: v for k, v in r.items() if k not in ("section", "kind", "t", "ok")}
        lines.append(f"resume: {'ok' if r['ok'] else 'FAILED'} " + json.dumps(details))
    lines += error_table(by_kind.get("error", []) + by_kind.get("error_failed", []))
    lines += bf16_tables(by_kind.get("bf16_error", []), by_kind.get("bf16_model", []), by_kind.get("bf16_failed", []))
    lines += timing_table(by_kind.get("timing", []) + by_kind.get("timing_failed", []), by_kind.get("ceilings", []))
    lines += memory_plan_lines(by_kind.get("memory_plan", []))
    lines += throughput_table(by_kind.get("throughput", []))
    for r in by_kind.get("planner_profile", []) + by_kind.get("planner_profile_failed", []):
        lines.append(
            f"planner profile {r['name']}: matmul {r['matmul_tflops']:.1f} TFLOP/s, copy "
            f"{r['copy_gbps']:.0f} GB/s, written to {r['file']}"
            if "file" in r
            else f"planner profile: calibration exit {r['rc']} after {r['seconds']} s (planner_profile_calibrate.log)"
        )
    for r in by_kind.get("parity", []) + by_kind.get("parity_failed", []):
        lines.append(
            f"parity after {r['steps']} bf16 steps: ours {r['ours']:.4f}, mamba_ssm {r['theirs']:.4f}, "
            f"relative difference {100 * r['rel_diff']:.2f}%"
            if "rel_diff" in r
            else f"parity: {r['error']}"
        )
    lines += profile_lines(by_kind.get("profile", []), by_kind.get("profile_op", []))
    for r in by_kind.get("triton_identity", []):
        lines.append(
            f"triton cache key inputs (triton_key, ptxas, env) as shipped: {r['match']}"
            + ("" if r["match"] else f" (here {r.get('here', r.get('error'))}, shipped {r['shipped']})")
        )
    lines += cache_lines(out, by_kind.get("triton_cache", []))
    return "\n".join(lines)


def error_table(rows) -> list:
    if not rows:
        return []
    lines = [
        "",
        "error vs float64 (relative norm)  ours / theirs = ratio (<= 2 wanted)",
        f"{'op':15s} {'dtype':9s} {'quantity':12s} {'ours':>9s} {'theirs':>9s} {'ratio':>6s}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['op']:15s} {r['dtype']:9s} FAILED: {r['error'][:120]}")
            continue
        theirs = f"{r['theirs']:9.2e}" if r["theirs"] is not None else "        -"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else "     -"
        lines.append(f"{r['op']:15s} {r['dtype']:9s} {r['quantity']:12s} {r['ours']:9.2e} {theirs} {ratio}")
    impls = sorted({(r["op"], r["theirs_impl"]) for r in rows if "theirs_impl" in r})
    lines += [f"  theirs for {op}: {impl}" for op, impl in impls]
    return lines


def bf16_tables(ops, model, failed) -> list:
    """bf16_errors.py's markdown tables of the errors section's bf16 records."""
    if not (ops or model or failed):
        return []
    bf16_errors = load_benchmark("bf16_errors")
    lines = ["", "bf16 error vs float64 (relative norm): ours, mamba_ssm, ours/theirs (benchmarks/bf16_errors.py)"]
    lines += bf16_errors.op_tables(ops) + bf16_errors.model_table(model)
    return lines + [f"bf16 {r['op']}: FAILED: {r['error'][:160]}" for r in failed]


def timing_table(rows, ceilings) -> list:
    if not rows:
        return []
    lines = [""]
    if ceilings:
        lines.append(
            f"roofline measured here: copy {ceilings[0]['copy_gbps']:.0f} GB/s, "
            f"bf16 matmul {ceilings[0]['matmul_tflops']:.0f} TFLOP/s; roof% = roofline time / time"
        )
    lines.append(f"{'op':15s} {'layer':14s} {'impl':44s} {'fwd ms':>9s} {'roof%':>6s} {'bwd ms':>9s} {'roof%':>6s}")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['op']:15s} {r['layer']:14s} {r['impl'][:44]:44s} FAILED: {r['error'][:80]}")
        else:
            lines.append(
                f"{r['op']:15s} {r['layer']:14s} {r['impl'][:44]:44s} {r['fwd_ms']:9.3f} "
                f"{100 * r['fwd_roof']:6.1f} {r['bwd_ms']:9.3f} {100 * r['bwd_roof']:6.1f}"
            )
    return lines


def throughput_table(rows) -> list:
    if not rows:
        return []
    lines = [
        "",
        "| size | engine | tokens/s | TFLOP/s | MFU | peak mem (GiB) | planned (GiB): total / activations |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['engine']} | failed: {r['error'][-160:]!r} | | | | |")
            continue
        mem = "" if r.get("mem_peak_gb") is None else f"{r['mem_peak_gb']:.1f}"
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        plan = (
            f"{r['planned_total_gb']:.1f} / {r.get('planned_activations_gb', float('nan')):.1f}"
            if r.get("planned_total_gb") is not None
            else ""
        )
        lines.append(
            f"| {r['size']} | {r['engine']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.1f} | "
            f"{mfu} | {mem} | {plan} |"
        )
    return lines


def memory_plan_lines(rows) -> list:
    lines = [""] if rows else []
    for r in rows:
        lines.append(
            f"memory plan {r['size']} (micro batch {r['micro_batch']} x {r['seq']}): kept "
            f"{r['kept_measured'] / 2**30:.2f} GiB measured, {r['kept_estimated'] / 2**30:.2f} estimated "
            f"({100 * r['kept_error']:.0f}% off); peak {r['peak_measured'] / 2**30:.2f} measured, "
            f"{r['peak_estimated'] / 2**30:.2f} estimated ({100 * r['peak_error']:.0f}% off; 20% allowed)"
        )
    return lines


def profile_lines(steps, ops) -> list:
    lines = []
    for r in steps:
        lines += [
            "",
            f"profile of one {r['size']} step (micro batch {r['micro_batch']} x {r['seq']}): "
            f"{r['wall_ms']:.1f} ms wall, {r['self_total_ms']:.1f} ms of {r['by']} ({r['table']})",
        ]
        lines += [
            f"  {o['self_ms']:9.2f} ms {100 * o['share']:5.1f}% {o['calls']:5d}x  {o['op'][:70]}"
            for o in ops
            if o["size"] == r["size"]
        ]
    return lines


def cache_lines(out: str, rows) -> list:
    """Triton's on-disk cache: entries shipped, entries compiled anew, and the hits and misses the
    sections' own processes saw (launch/train.py's processes are not counted there)."""
    lines = []
    path = os.path.join(out, COMPILES)
    if os.path.exists(path):
        with open(path) as f:
            events = [json.loads(line) for line in f if line.endswith("\n")]
        hits = sum(e["cache_hit"] for e in events)
        lines.append(
            f"triton compilations in the sections' processes: {hits} from the cache, {len(events) - hits} compiled anew"
        )
        missed = sorted({e["kernel"] for e in events if not e["cache_hit"]})
        if missed:
            lines.append("  compiled anew: " + ", ".join(missed)[:400])
    for r in rows:
        lines.append(
            f"triton cache {r['dir']}: {r['shipped']} entries shipped, {r['compiled_anew']} new entries "
            f"(all processes); check took {r['total_s']} s"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
