"""Compile every Triton kernel our ops launch for a CUDA GPU, on a machine without one.

    python benchmarks/gpu_check/compile_kernels.py [--arch 90|80] [--json PATH]

The ops run forward and backward on CPU tensors with Triton's launcher replaced by a recorder: each
launch is specialized as Triton's own launcher would specialize it on the GPU (argument types,
constexprs, integer and alignment hints, num_warps / num_stages), and every distinct specialization
is compiled to a cubin for the target. The launches come from the cases the GPU benchmark
(benchmarks/kernel_bench.py) checks and times, in float32 and bfloat16, past 64K tokens, and from a
training step of a Mamba-1 and a Mamba-2 layer (float32 and bf16 autocast, with and without
documents) and of Mamba-3 SISO and MIMO layers. Each kernel's registers, spilled bytes and shared
memory are read from its cubin and checked against what one block may use on the target, and the
largest grid it was launched with against CUDA's grid limits; the occupancy they allow (resident
warps per SM) is reported. Spills are the per-thread stack frame: a Triton kernel makes no calls and
keeps no local arrays, so its stack holds only what ptxas spills there (STL/LDL in the SASS;
cuobjdump's LOCAL column stays 0 for them). Exit 1 if a kernel fails to compile or does not fit; a
short table is printed last, details go to --json.
Run it without TRITON_INTERPRET, whose kernels are not compiled.
"""

import argparse
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # megamamba: as installed

# What one block may use (registers; shared memory, the opt-in maximum) and what one SM holds.
LIMITS = {
    90: dict(
        gpu="sm_90 (H100/H200)",
        regs_per_block=65536,
        shared_bytes=232448,
        regs_per_sm=65536,
        shared_per_sm=233472,
        warps_per_sm=64,
        blocks_per_sm=32,
    ),
    80: dict(
        gpu="sm_80 (A100)",
        regs_per_block=65536,
        shared_bytes=166912,
        regs_per_sm=65536,
        shared_per_sm=167936,
        warps_per_sm=64,
        blocks_per_sm=32,
    ),
}
MAX_GRID = (2**31 - 1, 65535, 65535)  # programs along x, y, z of one launch (every CUDA GPU)


class LaunchRecorder:
    """Stands in for JITFunction.run: keeps each distinct specialization instead of launching."""

    def __init__(self, target):
        from triton.compiler import make_backend

        self.backend = make_backend(target)
        self.case = None
        self.launches = {}
        self._binders = {}

    def run(self, jit, grid, args, kwargs):
        from triton.runtime.jit import create_function_from_signature

        if jit not in self._binders:
            self._binders[jit] = create_function_from_signature(jit.signature, jit.params, self.backend)
        bound, specialization, options = self._binders[jit](*args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(self.backend, kwargs, bound, specialization, options)
        grid = tuple(grid(bound) if callable(grid) else grid) + (1, 1)
        key = (jit.fn.__qualname__, repr(signature), repr(constexprs), repr(attrs), repr(options))
        if key not in self.launches:
            self.launches[key] = dict(
                jit=jit,
                signature=signature,
                constexprs=constexprs,
                attrs=attrs,
                options=options,
                case=self.case,
                grid=grid[:3],
            )
        else:
            self.launches[key]["grid"] = tuple(max(a, b) for a, b in zip(self.launches[key]["grid"], grid))

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._original = JITFunction.run
        JITFunction.run = lambda jit, *args, grid, warmup, **kwargs: self.run(jit, grid, args, kwargs)
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._original


def load_benchmark():
    """benchmarks/kernel_bench.py as a module (its inputs and op table)."""
    path = os.path.join(REPO, "benchmarks", "kernel_bench.py")
    spec = importlib.util.spec_from_file_location("benchmark_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op_cases(bench):
    """(case name, op name, (tensors, kwargs)) for the benchmark's checks and layer timings, on the CPU."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for op, dtype, label, inputs in bench.check_cases("cpu", gen):
        cases.append((f"check {str(dtype).replace('torch.', '')} {label}".rstrip(), op, inputs))
    for size, d_model in bench.MAMBA2_D_MODEL.items():
        shape = bench.mamba2_shape(d_model, tokens=2 * 2048)
        cases.append((f"time Mamba-2 {size}", "ssd_chunk_scan", bench.ssd_inputs(shape, torch.bfloat16, "cpu", gen)))
    for size, d_model in bench.MAMBA1_D_MODEL.items():
        shape = bench.mamba1_shape(d_model, tokens=2 * 2048)
        cases.append((f"time Mamba-1 {size}", "selective_scan", bench.scan_inputs(shape, torch.bfloat16, "cpu", gen)))
    for size, d_model in bench.MAMBA3_D_MODEL.items():
        for mimo in (False, True):
            shape = bench.mamba3_shape(d_model, tokens=2 * 2048, mimo=mimo)
            label = f"time Mamba-3 {size}{' MIMO' if mimo else ''}"
            cases.append((label, "mamba3_scan", bench.mamba3_inputs(shape, torch.bfloat16, "cpu", gen)))
            cases.append((label, "mamba3_scan_inputs", bench.mamba3_raw_inputs(shape, torch.bfloat16, "cpu", gen)))
    return cases


# Mamba-3's preprocessing kernels (the rest of its step launches the SSD kernels the op cases compile): SISO
# and MIMO, each with bf16 autocast on one step and documents on one, so every flag is compiled both ways.
MAMBA3_STEPS = (
    ("Mamba3", {"layer": "Mamba3"}, ((False, True), (True, False))),
    (
        "Mamba3 MIMO",
        {"layer": "Mamba3", "is_mimo": True, "mimo_rank": 4, "chunk_size": 16},
        ((False, False), (True, True)),
    ),
)


def model_steps():
    """(case name, step function) for one training step of a two-layer Mamba-1 and Mamba-2 model (the
    second block adds the residual in its fused pre-norm), with and without bf16 autocast and documents,
    and of Mamba-3 SISO and MIMO (MAMBA3_STEPS)."""
    from megamamba.config import MambaConfig
    from megamamba.model.lm import MambaLM

    every = tuple((autocast, docs) for autocast in (False, True) for docs in (False, True))
    layers = (("Mamba2", {"layer": "Mamba2"}, every), ("Mamba1", {"layer": "Mamba1"}, every), *MAMBA3_STEPS)
    steps = []
    for layer, ssm, variants in layers:
        config = MambaConfig.from_dict(dict(d_model=256, n_layer=2, vocab_size=512, ssm_cfg=ssm))
        model = MambaLM(config)
        for autocast, docs in variants:

            def step(model=model, autocast=autocast, docs=docs):
                ids = torch.randint(0, 512, (2, 600), generator=torch.Generator().manual_seed(0))
                seq_idx = (torch.arange(600) >= 250).int().expand(2, 600).contiguous() if docs else None
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(ids[:, :-1], ids[:, 1:], seq_idx=None if seq_idx is None else seq_idx[:, :-1])
                loss.backward()

            steps.append((f"{layer} step{' bf16' if autocast else ''}{' docs' if docs else ''}", step))
    return steps


def resources(cubin: bytes) -> dict:
    """Registers per thread and stack bytes per thread (the registers spilled) of a cubin's
    kernel, from the cuobjdump that ships with Triton."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return dict(regs=int(m.group(1)), stack_bytes=int(m.group(2)))


def resident_warps(regs: int, num_warps: int, shared_bytes: int, limits) -> int:
    """Warps of this kernel one SM can hold at once (occupancy), from its registers (allocated per
    warp in units of 256) and shared memory (plus 1 KiB the driver reserves per block)."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    blocks = min(
        limits["blocks_per_sm"],
        limits["warps_per_sm"] // num_warps,
        limits["regs_per_sm"] // (regs_per_warp * num_warps),
        limits["shared_per_sm"] // (shared_bytes + 1024),
    )
    return blocks * num_warps


def compile_launch(launch, target, limits) -> dict:
    """Compile one recorded specialization for `target`; its resources, and ok or what is wrong."""
    import triton
    from triton.compiler import ASTSource

    t0 = time.time()
    options = launch["options"]
    row = dict(
        kernel=launch["jit"].fn.__qualname__,
        case=launch["case"],
        num_warps=options.num_warps,
        num_stages=options.num_stages,
        max_grid=list(launch["grid"]),
        signature={k: str(v) for k, v in launch["signature"].items()},
    )
    try:
        source = ASTSource(launch["jit"], launch["signature"], launch["constexprs"], launch["attrs"])
        compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as e:
        return dict(row, ok=False, error=f"{type(e).__name__}: {e}", seconds=round(time.time() - t0, 2))
    row.update(
        resources(compiled.asm["cubin"]), shared_bytes=compiled.metadata.shared, seconds=round(time.time() - t0, 2)
    )
    row["warps_per_sm"] = resident_warps(row["regs"], row["num_warps"], row["shared_bytes"], limits)
    regs_per_block = row["regs"] * 32 * row["num_warps"]
    problems = []
    if regs_per_block > limits["regs_per_block"]:
        problems.append(f"{regs_per_block} registers per block > {limits['regs_per_block']}")
    if row["shared_bytes"] > limits["shared_bytes"]:
        problems.append(f"{row['shared_bytes']} B shared memory > {limits['shared_bytes']}")
    if any(g > m for g, m in zip(launch["grid"], MAX_GRID)):
        problems.append(f"grid {launch['grid']} > {MAX_GRID}")
    return dict(row, ok=not problems, error="; ".join(problems) or None)


_LAUNCHES = None  # (launches, target, limits) that forked compile workers inherit


def compile_all(launches, target, limits) -> list:
    """compile_launch for every launch, in forked workers (one per core; the compiler is single-threaded)."""
    global _LAUNCHES
    _LAUNCHES = (launches, target, limits)
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        return pool.map(_compile_nth, range(len(launches)), chunksize=1)


def _compile_nth(i):
    launches, target, limits = _LAUNCHES
    return compile_launch(launches[i], target, limits)


def record_launches(target) -> tuple:
    """Run every case under the recorder; returns (launches, case names)."""
    os.environ["MEGAMAMBA_KERNELS"] = "triton"
    bench = load_benchmark()
    table = bench.ops()
    names = []
    with LaunchRecorder(target) as recorder:
        for case, op, (tensors, kwargs) in op_cases(bench):
            recorder.case = f"{op}: {case}"
            names.append(recorder.case)
            bench.forward_backward(table[op][0], tensors, kwargs)
        for case, step in model_steps():
            recorder.case = case
            names.append(case)
            step()
    return list(recorder.launches.values()), names


def summary(rows, arch) -> str:
    """One line per kernel: specializations, worst registers / spills / shared memory / occupancy
    (resident warps per SM, of 64), failures."""
    lines = [
        f"Triton kernels compiled for {LIMITS[arch]['gpu']}",
        f"{'kernel':24s} {'specs':>5s} {'warps':>5s} {'regs':>5s} {'spill B':>8s} {'shared KiB':>10s} "
        f"{'warps/SM':>8s}  status",
    ]
    for kernel in sorted({r["kernel"] for r in rows}):
        mine = [r for r in rows if r["kernel"] == kernel]
        done = [r for r in mine if "regs" in r]
        failed = [r for r in mine if not r["ok"]]
        warps = "/".join(str(w) for w in sorted({r["num_warps"] for r in mine}))
        regs = max((r["regs"] for r in done), default=0)
        spill = max((r["stack_bytes"] for r in done), default=0)
        shared = max((r["shared_bytes"] for r in done), default=0) / 1024
        resident = min((r["warps_per_sm"] for r in done), default=0)
        status = "ok" if not failed else f"FAILED {len(failed)}: {failed[0]['error'][:200]}"
        lines.append(
            f"{kernel:24s} {len(mine):5d} {warps:>5s} {regs:5d} {spill:8d} {shared:10.1f} {resident:8d}  {status}"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(LIMITS), help="CUDA compute capability")
    default_json = os.path.join(os.environ["OUT"], "compile_kernels.json") if os.environ.get("OUT") else None
    parser.add_argument(
        "--json",
        help="where to write the details (default $OUT/compile_kernels.json when OUT is set)",
        default=default_json,
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: interpreted kernels are not compiled; unset it")
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    t0 = time.time()
    launches, cases = record_launches(target)
    rows = compile_all(launches, target, LIMITS[args.arch])
    report = dict(
        triton=triton.__version__,
        torch=torch.__version__,
        arch=args.arch,
        cases=cases,
        kernels=rows,
        seconds=round(time.time() - t0, 1),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(summary(rows, args.arch))
    print(f"{len(rows)} specializations from {len(cases)} cases, triton {triton.__version__}, {report['seconds']} s")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
