"""Build launch/profiles/h200.json from what one H200 measured (benchmarks/RESULTS.md), each number with its source.

    python benchmarks/h200_profile.py [--out launch/profiles/h200.json]

The planner counts each kernel's FLOPs and bytes (`megamamba.model.layer_types`); a kernel kind's forward is
a fixed cost plus its roofline time over an efficiency, its backward a ratio of that. Here each kind the GPU
check timed (RESULTS.md, 2026-12-04, "Op timings": our kernels, CUDA events, 16K tokens, the Mamba-2
130M/370M/1.3B and Mamba-1 130M/1.4B layer shapes) is fitted in the planner's own terms: the planner's count
for that layer shape at the measured ceilings gives the roofline seconds, a least-squares line through
(roofline, measured forward) gives the fixed cost and the efficiency, and the measured backward over the
forward the ratio. What was not measured is written as "assumed: ..." with the reason.
"""

import argparse
import json
import os
import statistics
import tempfile

from megamamba import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape, norm
from megamamba.pipelines.planner.calibrate_engine import parameter_count
from megamamba.pipelines.planner.measured_runs import load_runs, predict
from megamamba.pipelines.planner.profile import ADAMW_BYTES_PER_PARAMETER, load_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "benchmarks", "measured_runs.json")
DATED = "benchmarks/RESULTS.md, 2026-12-04 (one H200, torch 2.11, Triton 3.6)"
CEILINGS = f"{DATED}: 'The device's ceilings, measured in the same run'"
OPS = f"{DATED}, 'Op timings' (our kernels, bf16, 16K tokens = batch 8 x 2048, CUDA events)"
MATMUL_FLOPS, COPY_BYTES = 784e12, 4140e9  # measured; 2026-12-01 measured about 790 TFLOP/s and 4.3 TB/s
TOKENS_BATCH = 8  # 8 x 2048 = the op timings' 16K tokens

# (layer shape's model config, forward ms, forward+backward ms), ours, from the op timings table
SSD = [("mamba2-130m", 0.492, 4.092), ("mamba2-370m", 0.623, 5.351), ("mamba2-1.3b", 1.168, 10.349)]
CONV = [("mamba2-130m", 0.113, 0.799), ("mamba2-370m", 0.124, 0.759), ("mamba2-1.3b", 0.154, 0.719)]
GATED_NORM = [("mamba2-130m", 0.130, 0.567), ("mamba2-370m", 0.113, 0.642), ("mamba2-1.3b", 0.151, 0.804)]
ADD_NORM = [("mamba2-130m", 0.145, 0.971), ("mamba2-370m", 0.139, 0.657), ("mamba2-1.3b", 0.173, 0.822)]
SCAN = [("mamba1-130m", 1.344, 10.420), ("mamba1-1.4b", 3.292, 27.351)]
# --calibrate on the same H200 (RESULTS.md 2026-12-04, 'Planner profile'): a 768 x 3072 GEMM over 8K tokens
# at 382 TFLOP/s, each call timed with a synchronize, whose round trip the same run measured as 36.5 us
GEMM_TFLOPS, GEMM_SHAPE, SYNC_S = 382e12, (8192, 768, 3072), 36.5e-6
# the fused AdamW kernels of one 1.3b step (RESULTS.md 2026-12-04, 'Profile of one 1.3b training step')
ADAMW_S, ADAMW_MODEL = 10.7e-3, "mamba2-1.3b"
ENGINE_MS = {"0": 4.5, "1": 25.3, "2": 48.5}  # --calibrate's engine step on that H200, one rank, mamba2-130m


def model(name: str) -> MambaConfig:
    return MambaConfig.from_json(os.path.join(REPO, "launch", "models", f"{name}.json"))


def roofline(kernel) -> float:
    return max(kernel.flops / MATMUL_FLOPS, kernel.bytes / COPY_BYTES)


def mixer_kernel(name: str, kind: str, index: int = 0):
    """The `index`-th kernel of `kind` the planner counts for one Mamba layer of `name` at the op timings' shape."""
    m = model(name)
    work = layer_type(m.block_kinds[0]).work(RankShape(m, TOKENS_BATCH, 2048))
    return [k for k in work.kernels if k.kind == kind][index]


def fit(points: list) -> dict:
    """Kernel fields from (roofline s, forward s, forward+backward s): forward = fixed + roofline / efficiency
    (least squares; through the origin when the intercept would be negative; a kernel whose time grows slower
    than its roofline at efficiency 1 and the mean rest as its fixed cost), backward = ratio x forward."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    if slope < 1:
        fixed, slope = max(0.0, my - mx), 1.0
    elif fixed < 0:
        fixed, slope = 0.0, sum(ys) / sum(xs)
    backward = sum(t - f for _, f, t in points) / sum(f for _, f, _ in points)
    return {"efficiency": 1 / slope, "backward_ratio": backward, "fixed_s": fixed}


def measured_points(rows: list, kernel_of) -> list:
    return [(roofline(kernel_of(name)), fwd / 1e3, both / 1e3) for name, fwd, both in rows]


def described(fields: dict, what: str) -> str:
    return (
        f"fitted from {what}: {fields['fixed_s'] * 1e6:.0f} us + roofline / {fields['efficiency']:.3g}, "
        f"backward {fields['backward_ratio']:.2f} x forward"
    )


def kernels_and_sources() -> tuple:
    kernels, sources = {}, {}
    ssd = fit(measured_points(SSD, lambda n: mixer_kernel(n, "ssd")))
    conv = fit(measured_points(CONV, lambda n: mixer_kernel(n, "conv")))
    gated = measured_points(GATED_NORM, lambda n: mixer_kernel(n, "norm", 1))
    added = measured_points(ADD_NORM, lambda n: norm(RankShape(model(n), TOKENS_BATCH, 2048)))
    norms = fit(gated + added)
    scan = fit(measured_points(SCAN, lambda n: mixer_kernel(n, "scan")))
    for kind, fields, what in (
        ("ssd", ssd, f"{OPS}, ssd_chunk_scan ours at the three Mamba-2 shapes"),
        ("conv", conv, f"{OPS}, causal_conv1d ours at the three Mamba-2 shapes"),
        ("norm", norms, f"{OPS}, rmsnorm_gated and add_rmsnorm ours at the three Mamba-2 shapes"),
        ("scan", scan, f"{OPS}, selective_scan ours at the Mamba-1 130M and 1.4B shapes"),
    ):
        kernels[kind] = fields
        sources[f"kernels.{kind}"] = described(fields, what) + (
            "; mamba_ssm's, measured beside it, is not used: the planner predicts our kernels"
            if kind != "scan"
            else "; mamba_ssm's selective scan was not measured (its CUDA extension was not built)"
        )
    t, k, n = GEMM_SHAPE
    ideal = 2 * t * k * n / MATMUL_FLOPS
    gemm_fixed = 2 * t * k * n / GEMM_TFLOPS - SYNC_S - ideal
    kernels["matmul"] = {"efficiency": 1.0, "backward_ratio": 2.0, "fixed_s": gemm_fixed}
    sources["kernels.matmul"] = (
        f"{DATED}, 'Planner profile' (--calibrate: a {k} x {n} GEMM over {t} tokens at 382 TFLOP/s, each call "
        f"timed with a synchronize whose round trip the same run measured at 36.5 us): less that round trip, "
        f"{gemm_fixed * 1e6:.0f} us per call beyond the measured ceiling's time, so the efficiency depends on "
        f"the shape, flops / (flops + {gemm_fixed * MATMUL_FLOPS / 1e9:.0f} GFLOP): "
        f"{ideal / (ideal + gemm_fixed):.0%} for that GEMM, above 90% for the 1.3b layer's, as the 1.3b step's "
        "profile shows (its cuBLAS kernels about 80 ms for about 66 TFLOP); skinny GEMMs are bound by their bytes "
        "at the copy rate; backward: two GEMMs of the forward's size"
    )
    kernels["elementwise"] = {"efficiency": 0.65, "backward_ratio": 2.0}
    sources["kernels.elementwise"] = (
        f"{DATED}, 'Planner profile': elementwise at 0.65 of the copy rate (--calibrate's fit); backward assumed "
        "2 x forward"
    )
    kernels["matmul_fp32"] = {"efficiency": 67e12 / MATMUL_FLOPS, "backward_ratio": 2.0}
    sources["kernels.matmul_fp32"] = (
        "assumed: float32 matmuls (TF32 off) at the datasheet's 67 TFLOP/s of the non-tensor cores, over the "
        "measured bf16 ceiling; not measured"
    )
    kernels["attention"] = {"efficiency": 0.5, "backward_ratio": 2.5}
    sources["kernels.attention"] = (
        "assumed: attention at half the measured matmul ceiling, backward 2.5 x forward (a fused attention "
        "kernel's usual split); no attention was measured on the H200"
    )
    return kernels, sources


def build() -> dict:
    kernels, sources = kernels_and_sources()
    parameters = parameter_count(model(ADAMW_MODEL))
    adamw = ADAMW_BYTES_PER_PARAMETER * parameters / COPY_BYTES / ADAMW_S
    sources.update(
        {
            "device_memory_bytes": "published: 141 GB of HBM3e; 150,754,820,096 bytes as torch reports the H200",
            "matmul_flops_per_s": f"{CEILINGS}: bf16 matmul 784 TFLOP/s (2026-12-01: about 790)",
            "copy_bytes_per_s": f"{CEILINGS}: copy 4,140 GB/s (2026-12-01: about 4.3 TB/s)",
            "peak_flops_per_s": "published: the H200 datasheet's 989 TFLOP/s dense bf16, the MFU's denominator",
            "launch_s": (
                "assumed: 4 us between queued kernels; --calibrate's 36.5 us (2026-12-04) is a synchronous round "
                "trip, an upper bound, and the 1.3b step's profile (kernel time 397 ms in 392 ms of wall time) "
                "shows no gaps to measure"
            ),
            "optimizer": (
                f"{DATED}, 'Profile of one 1.3b training step': fused AdamW's kernels 10.7 ms for the "
                f"{parameters / 1e9:.2f}B parameters of mamba2-1.3b, at {ADAMW_BYTES_PER_PARAMETER} bytes each "
                "(parameter, gradient, two moments read, three written; the gradient norm's read): "
                f"{adamw:.2f} of the copy rate"
            ),
            "engine": (
                f"{DATED}, 'Planner profile': --calibrate's engine step at ZeRO 0 / 1 / 2 on one rank, mamba2-130m "
                "(4.5 / 25.3 / 48.5 ms); its cost per micro-batch was not reported: assumed 0"
            ),
            "links": (
                "assumed: NVLink 450 GB/s each way and 400 Gb/s NDR per GPU (datasheet peaks), 5 / 15 us per ring "
                "step; no collective was measured on the H200 (one GPU)"
            ),
        }
    )
    return {
        "name": "H200 SXM 141GB",
        "source": f"measured: {DATED} and 2026-12-01; every number's source under 'sources'",
        "device_memory_bytes": 150754820096,
        "matmul_flops_per_s": MATMUL_FLOPS,
        "copy_bytes_per_s": COPY_BYTES,
        "peak_flops_per_s": 989e12,
        "launch_s": 4e-6,
        "kernels": kernels,
        "optimizer": {"bytes_per_parameter": ADAMW_BYTES_PER_PARAMETER, "efficiency": min(1.0, adamw)},
        "engine": {stage: {"micro_batch_s": 0.0, "step_s": ms / 1e3} for stage, ms in ENGINE_MS.items()},
        "links": {
            "intra_node": {"alpha_s": 5e-06, "bytes_per_s": 450e9},
            "inter_node": {"alpha_s": 1.5e-05, "bytes_per_s": 50e9},
        },
        "sources": dict(sorted(sources.items())),
    }


def whole_step_scale(profile: dict) -> tuple:
    """(model scale, text): the median over the 2026-12-04 runs of ours of their measured step time, less what
    the profile predicts beside the layers, over the layers' predicted time."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(profile, f)
        f.flush()
        loaded = load_profile(f.name)
    ratios = []
    for run in load_runs(RUNS):
        if run.engine == "ours" and run.gpu == "H200":
            time = predict(run, loaded).time
            measured = run.micro_batch_size * run.grad_accum * run.seq_length / run.tokens_per_s
            ratios.append((run.model, (measured - (time.total - time.compute)) / time.compute))
    scale = statistics.median(r for _, r in ratios)
    return scale, (
        f"fitted: the median over the runs of ours in {DATED}, 'Training throughput' (benchmarks/measured_runs.json) "
        "of the measured step, less the optimizer and engine predicted, over the layers predicted: "
        + ", ".join(f"{name} {r:.3f}" for name, r in ratios)
        + "; the layers run faster inside a step than the op timings' five calls each"
    )


def best_measured_mfu(peak: float) -> tuple:
    """(MFU, text): the highest MFU of the H200 runs of benchmarks/measured_runs.json against `peak`."""
    best = max((r for r in load_runs(RUNS) if r.gpu == "H200"), key=lambda r: r.mfu(peak))
    return best.mfu(peak), (
        f"the best of the H200 runs of benchmarks/measured_runs.json: {best.engine} {best.model}, "
        f"{best.tokens_per_s:,.0f} tokens/s ({best.section}), against the datasheet peak"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "launch", "profiles", "h200.json"))
    args = p.parse_args(argv)
    profile = build()
    profile["model_scale"], profile["sources"]["model_scale"] = whole_step_scale(profile)
    profile["measured_mfu"], profile["sources"]["measured_mfu"] = best_measured_mfu(profile["peak_flops_per_s"])
    profile["sources"] = dict(sorted(profile.pop("sources").items()))
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
