"""Training-throughput benchmark on one CUDA GPU: our DeepSpeed engine next to mamba_ssm with plain AMP.

    python benchmarks/train.py [--sizes 130m 370m 1.3b] [--steps 8] [--seq-length 2048]
        [--launch-size 2.7b] [--mamba-ssm-src PATH] [--peak-tflops 989] [--results benchmarks/RESULTS.md]

For each Mamba-2 size (launch/models/mamba2-<size>.json, batch split of launch/configs/mamba2-<size>.json):
  ours      launch/train.py as one rank: DeepSpeed engine, ZeRO-1, bf16 torch_autocast, float32
            parameters, our Triton kernels;
  mamba_ssm its MambaLMHeadModel (Triton SSD path, use_mem_eff_path=False, no causal-conv1d package)
            trained with torch.autocast(bf16) + torch AdamW (fused) on float32 parameters, the same
            micro-batch, accumulation steps, sequence length and gradient clipping;
then a few steps of --launch-size through `deepspeed --num_gpus 1 launch/train.py`.
Reported per run: tokens/s, TFLOP/s (megamamba.model.flops, the same count for both), MFU against
--peak-tflops, peak GPU memory; the first --warmup steps (compilation, autotuning) are left out.
mamba_ssm comes from its unpacked source release (--mamba-ssm-src, the folder holding mamba_ssm/);
its compiled extension and the modules of its package that only generation needs are stubbed.
megamamba is imported as installed (`pip install -e .`, or benchmarks/gpu_check/gpu_check.sh's site folder),
never from the checkout: megamamba.kernels and megamamba.pipelines exist only once installed.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = ("130m", "370m", "1.3b", "2.7b")
H200_PEAK_TFLOPS = 989.0  # dense bf16, the H100/H200 datasheet figure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["130m", "370m", "1.3b"], choices=SIZES)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument(
        "--launch-size",
        default="2.7b",
        choices=SIZES + ("none",),
        help="config run through the deepspeed launcher at the end",
    )
    p.add_argument("--launch-steps", type=int, default=4)
    p.add_argument("--mamba-ssm-src", default=None, help="unpacked mamba_ssm source release")
    p.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS)
    p.add_argument("--results", default=None, help="append the table to this markdown file")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _paths(size):
    return (
        os.path.join(REPO, f"launch/configs/mamba2-{size}.json"),
        os.path.join(REPO, f"launch/models/mamba2-{size}.json"),
    )


def _train_flags(ds_config, model_config, steps, seq_length, peak_tflops, metrics):
    """launch/train.py's flags; its DeepSpeed config is copied beside `metrics` without the
    tensorboard block: event files are not what is measured, and the GPU machine has no tensorboard."""
    with open(ds_config) as f:
        config = {k: v for k, v in json.load(f).items() if k != "tensorboard"}
    ds_config = os.path.join(os.path.dirname(metrics), "ds_config.json")
    with open(ds_config, "w") as f:
        json.dump(config, f)
    return [
        os.path.join(REPO, "launch/train.py"),
        "--deepspeed_config",
        ds_config,
        "--model-config",
        model_config,
        "--train-iters",
        str(steps),
        "--seq-length",
        str(seq_length),
        "--log-interval",
        "1",
        "--metrics-jsonl",
        metrics,
        "--peak-tflops",
        str(peak_tflops),
    ]


def averaged(records, warmup):
    """Mean throughput over the steps after the warm-up; the largest peak memory."""
    timed = [r for r in records if r["step"] >= warmup] or records
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return {
        "tokens_per_s": mean("tokens_per_s"),
        "tflops_per_device": mean("tflops_per_device"),
        "mfu": mean("mfu") if "mfu" in timed[0] else None,
        "mem_peak_gb": max(r["mem_peak_gb"] for r in records),
        "final_loss": records[-1]["loss"],
    }


def run_ours(size, args, launcher=False):
    """launch/train.py on one GPU, as a plain process (one rank) or through the deepspeed launcher."""
    return train_ours(
        *_paths(size),
        args.launch_steps if launcher else args.steps,
        1 if launcher else args.warmup,
        args.seq_length,
        args.peak_tflops,
        launcher,
    )


def train_ours(ds_config, model_config, steps, warmup, seq_length, peak_tflops, launcher=False, log=None, timeout=None):
    """Averaged metrics of launch/train.py on one device, with the installed megamamba (the checkout
    is not put on the import path). Its output streams to `log` (a temporary file when None, its
    tail returned on failure); past `timeout` seconds it is stopped (SIGTERM, then SIGKILL)."""
    from megamamba.testing.processes import run_logged

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        flags = _train_flags(ds_config, model_config, steps, seq_length, peak_tflops, metrics)
        env = dict(os.environ)
        if launcher:
            cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(_free_port()), *flags]
        else:
            cmd = [sys.executable, *flags]
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        log = log or os.path.join(tmp, "train.log")
        status = run_logged(cmd, log, timeout or 24 * 3600, env=env, cwd=tmp)
        records = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.endswith("\n")]
        if status["rc"] != 0 or not records:
            with open(log, errors="replace") as f:
                return {
                    "error": f"exit {status['rc']}{' (timed out)' if status['timed_out'] else ''}: " + f.read()[-1500:],
                    "wall_s": status["seconds"],
                }
    return {**averaged(records, warmup), "wall_s": status["seconds"]}


def load_mamba_ssm(src):
    """mamba_ssm's (MambaLMHeadModel, MambaConfig) from its source release (extension stubbed, autotuning
    capped to one config per kernel), or (None, why not)."""
    from megamamba.testing.mamba_ssm_release import load

    theirs, how = load(src)
    return (None if theirs is None else (theirs.MambaLMHeadModel, theirs.MambaConfig)), how


def run_mamba_ssm(size, args, classes):
    """mamba_ssm's model, AMP bf16, fused torch AdamW, same batch split as our config."""
    return train_mamba_ssm(classes, *_paths(size), args.steps, args.warmup, args.seq_length, args.peak_tflops)


def train_mamba_ssm(classes, ds_config, model_config, steps, warmup, seq_length, peak_tflops, device="cuda"):
    """mamba_ssm's MambaLMHeadModel trained on `device` with autocast(bf16) and torch AdamW on float32
    parameters, the micro-batch, accumulation and clipping of our DeepSpeed config; averaged metrics."""
    import torch
    import torch.nn.functional as F

    from megamamba import MambaConfig as OurConfig
    from megamamba.model.flops import training_flops_per_token

    MambaLMHeadModel, TheirConfig = classes
    device = torch.device(device)
    cuda = device.type == "cuda"
    with open(ds_config) as f:
        batch = json.load(f)
    micro = batch["train_micro_batch_size_per_gpu"]
    accum = batch.get("gradient_accumulation_steps") or batch.get("train_batch_size", micro) // micro
    ours = OurConfig.from_json(model_config)
    fields = {**ours.to_dict(), "ssm_cfg": {**ours.ssm_cfg, "use_mem_eff_path": False}}
    model = MambaLMHeadModel(TheirConfig(**fields), device=device, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    ids = torch.randint(0, ours.vocab_size, (micro, seq_length + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    flops_per_step = training_flops_per_token(ours, seq_length) * micro * accum * seq_length
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        for _ in range(accum):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(inputs).logits
            loss = F.cross_entropy(logits[..., : ours.vocab_size].float().flatten(0, 1), labels.flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    seconds = sum(times[warmup:]) / max(1, len(times[warmup:]))
    tflops = flops_per_step / seconds / 1e12
    result = {
        "tokens_per_s": micro * accum * seq_length / seconds,
        "tflops_per_device": tflops,
        "mfu": tflops / peak_tflops,
        "mem_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "final_loss": loss.item() * accum,
    }
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return result


def table(rows) -> str:
    """Markdown: one line per (size, engine) with tokens/s, TFLOP/s, MFU, peak memory, or the error."""
    lines = ["| size | engine | tokens/s | TFLOP/s | MFU | peak mem (GiB) |", "| --- | --- | --- | --- | --- | --- |"]
    for size, engine, r in rows:
        if "error" in r:
            lines.append(f"| {size} | {engine} | failed: {r['error'][-200:]!r} | | | |")
            continue
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {size} | {engine} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.1f} | {mfu} | "
            f"{r['mem_peak_gb']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train.py needs a CUDA GPU")
    classes, how = load_mamba_ssm(args.mamba_ssm_src)
    print(f"mamba_ssm: {how}", flush=True)
    rows = []
    for size in args.sizes:
        rows.append((size, "ours (DeepSpeed ZeRO-1, bf16 autocast)", run_ours(size, args)))
        print(table(rows[-1:]), flush=True)
        if classes is not None:
            try:
                rows.append((size, "mamba_ssm + torch AMP", run_mamba_ssm(size, args, classes)))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: reported, the others still run
                rows.append((size, "mamba_ssm + torch AMP", {"error": repr(exc)}))
            print(table(rows[-1:]), flush=True)
    if args.launch_size != "none":
        rows.append((args.launch_size, "ours via `deepspeed --num_gpus 1`", run_ours(args.launch_size, args, True)))
    text = (
        f"\n### Training throughput ({torch.cuda.get_device_name()}, seq {args.seq_length}, "
        f"{args.steps} steps, MFU vs {args.peak_tflops:g} TFLOP/s)\n\n{table(rows)}\n"
    )
    print(text, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
