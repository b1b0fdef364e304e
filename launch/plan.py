"""Pick a parallel layout for a model on N GPUs: a ranked table of feasible plans with their memory and
predicted step time, where the best plan's time goes, and why the other layouts were rejected.

    python launch/plan.py --model-config launch/models/mamba2-1.3b.json --gpus 64 --gpus-per-node 8 \\
        --seq-length 4096 --global-batch-size 512 [--profile launch/profiles/h100-80gb.json] [--top 5] [--json]
    python launch/plan.py --calibrate --out my-machine.json --model-config M --seq-length S [--ranks 2]

The memory of each plan is the start-up memory plan's (pipelines/memory); the time model is
pipelines/planner/step_time.py with the profile's rates. No GPU is needed to plan; --calibrate measures
the machine it runs on (its GPU, or the CPU) at the model's shapes.
"""

import argparse
import contextlib
import json
import math
import os
import sys

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator choice to stdout: keep --json clean
    from megamamba.config import ConfigError, MambaConfig
    from megamamba.errors import MegamambaError
    from megamamba.pipelines.planner.profile import load_profile
    from megamamba.pipelines.planner.report import search_dict, search_lines
    from megamamba.pipelines.planner.search import Request, search

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model-config", required=True, help="a model config.json (launch/models/)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's profile into --out")
    p.add_argument("--out", help="with --calibrate: the profile file to write")
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="with --calibrate: processes for the collectives and the "
        "TP/CP steps (as many as there are GPUs; with one, the links of --profile are kept)",
    )
    p.add_argument("--micro-batch-size", type=int, default=1, help="with --calibrate: sequences per kernel call")
    p.add_argument("--gpus", type=int, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: min(gpus, 8))")
    p.add_argument(
        "--gpu-memory",
        type=memory_bytes,
        help="memory per GPU: 80 (GiB), 141GiB or 80GB (default: the profile's)",
    )
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    p.add_argument(
        "--profile",
        default=os.path.join(PROFILES, "h100-80gb.json"),
        help="hardware profile JSON (launch/profiles/, or written by --calibrate)",
    )
    p.add_argument("--top", type=int, default=5, help="plans to list")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    needed = ["out"] if args.calibrate else ["gpus", "global_batch_size"]
    missing = [f"--{n.replace('_', '-')}" for n in needed if getattr(args, n) is None]
    if missing:
        p.error(f"{' and '.join(missing)} required{' with --calibrate' if args.calibrate else ''}")
    return args


def calibrate_profile(args, model: MambaConfig) -> None:
    import torch

    from megamamba.pipelines.planner.calibrate import calibrate, measure_links

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ranks = min(args.ranks, torch.cuda.device_count()) if device.type == "cuda" else args.ranks  # NCCL: a GPU each
    if ranks < 2:
        links, where = load_profile(args.profile).links, f"{args.profile}'s (one rank here)"
    else:
        links, where = measure_links(ranks), f"all-reduces on {ranks} processes here, one tier used for both"
    profile = calibrate(model, args.seq_length, args.micro_batch_size, device, links, where, ranks >= 2)
    profile.to_json(args.out)
    print(
        f"wrote {args.out}: {profile.name}, matmul {profile.matmul_flops_per_s / 1e12:.3f} TFLOP/s, copy "
        f"{profile.copy_bytes_per_s / 1e9:.1f} GB/s, launch {profile.launch_s * 1e6:.1f} us, AdamW at "
        f"{profile.adamw.efficiency:.2f} of the copy rate; "
        + ", ".join(
            f"{k} {v.fixed_s * 1e6:.1f} us + {v.efficiency:.3g} of the roofline (backward x{v.backward_ratio:.2f})"
            for k, v in profile.kernels.items()
        )
        + "; engine per micro-batch / step: "
        + ", ".join(
            f"ZeRO {z} {e.micro_batch_s * 1e3:.2f} / {e.step_s * 1e3:.2f} ms" for z, e in profile.engine.items()
        )
        + "".join(
            f"; a {g.upper()} collective {s * 1e6:.0f} us beyond its ring" for g, s in profile.collective_call_s.items()
        )
    )


MEMORY_UNITS = {"gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6}


def memory_bytes(text: str) -> int:
    """--gpu-memory: '80GiB' (2^30), '80GB' (10^9), MiB, MB, or a bare number of GiB ('80')."""
    number, unit = text.strip(), "gib"
    for name in MEMORY_UNITS:
        if number.lower().endswith(name):
            number, unit = number[: -len(name)].strip(), name
            break
    try:
        size = float(number) * MEMORY_UNITS[unit]
    except ValueError:
        size = math.nan
    if not size > 0 or math.isinf(size):
        raise argparse.ArgumentTypeError(f"{text!r}: give the memory per GPU as e.g. 80 (GiB), 80GiB or 80GB")
    return int(size)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = MambaConfig.from_json(args.model_config)
        if args.calibrate:
            calibrate_profile(args, model)
            return 0
        profile = load_profile(args.profile)
        request = Request(
            model,
            args.gpus,
            args.gpus_per_node or min(args.gpus, 8),
            args.seq_length,
            args.global_batch_size,
            args.gpu_memory or profile.device_memory_bytes,
        )
        result = search(request, profile)
    except (MegamambaError, ConfigError, OSError, ValueError) as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"profile": {"name": profile.name, "source": profile.source}} | search_dict(result, args.top), indent=1
            )
        )
    else:
        print(f"profile: {profile.name} ({profile.source})")
        print("\n".join(search_lines(result, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
