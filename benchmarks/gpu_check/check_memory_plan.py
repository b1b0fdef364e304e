"""GPU check of the memory plan's activation estimate (pipelines/memory/activations.py) on one rank.

    python benchmarks/gpu_check/check_memory_plan.py --size 130m [--checkpoint-activations-interval 1] [--dry-run]

The size's DeepSpeed config (bf16 autocast, its micro batch) with ZeRO 0 and one accumulation step
at (1,1,1), seq 2048. After a first step (the optimizer state exists), one micro-batch is measured:
  kept  memory_allocated after the forward minus before it; estimate: `kept_bytes`, what the
        micro-batch keeps for its backward;
  peak  max_memory_allocated over the forward and backward minus before; estimate: the plan's
        activations plus the gradients not allocated before (gradients build up while activations
        are freed, so the sum bounds the peak from above) plus DeepSpeed's buffers.
Prints one JSON line; exits 1 when either estimate is off by more than --tolerance (20%) of the
measurement. --dry-run: the tiny CPU model and config, seq 64, no tolerance (host memory figures).
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_script():
    spec = importlib.util.spec_from_file_location("megamamba_train_script", os.path.join(REPO, "launch", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _zero0_config(path: str, folder: str) -> str:
    """The size's DeepSpeed config with ZeRO 0, one accumulation step and no TensorBoard, written in `folder`."""
    with open(path) as f:
        config = json.load(f)
    config.update(zero_optimization={"stage": 0}, gradient_accumulation_steps=1)
    config.pop("tensorboard", None)
    config.pop("train_batch_size", None)
    out = os.path.join(folder, "ds_config.json")
    with open(out, "w") as f:
        json.dump(config, f)
    return out


def measure(size: str, checkpoint_interval: int, dry: bool, scratch: str) -> dict:
    """The kept and peak figures, measured and estimated; the run's DeepSpeed config is written in `scratch`."""
    from deepspeed.accelerator import get_accelerator

    from megamamba.model.layer_types.costs import RankShape
    from megamamba.parallel.groups import init_distributed, shutdown_distributed
    from megamamba.pipelines.loop.engine import build_trainer
    from megamamba.pipelines.memory.activations import kept_bytes
    from megamamba.pipelines.memory.plan import RunShape, plan_memory

    ds, model = ("tiny-cpu", "tiny-mamba2") if dry else (f"mamba2-{size}", f"mamba2-{size}")
    script = _train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            _zero0_config(os.path.join(REPO, "launch/configs", f"{ds}.json"), scratch),
            "--model-config",
            os.path.join(REPO, "launch/models", f"{model}.json"),
            "--train-iters",
            "2",
            "--seq-length",
            "64" if dry else "2048",
            "--checkpoint-activations-interval",
            str(checkpoint_interval),
        ]
    )
    plan = script.prepare(args, 1)
    layout = plan.layout
    init_distributed()
    trainer = build_trainer(
        layout,
        plan.model,
        plan.engine_config,
        plan.optimizer,
        args.seed,
        args.partition_method,
        checkpoint_interval,
        seq_length=args.seq_length,
    )
    shape = RunShape.of_run(
        plan.model, layout, plan.engine_config, args.seq_length, args.partition_method, checkpoint_interval, False
    )
    stage = plan_memory(shape).stages[0]
    accelerator = get_accelerator()
    trainer.train_step(plan.data.train.micro_batches(0, 0, 1, layout.micro_batch_size))
    accelerator.synchronize()
    grads = sum(p.grad.numel() * p.grad.element_size() for _, _, p in trainer.named_parameters() if p.grad is not None)
    inputs, labels, seq_idx = plan.data.train.micro_batches(1, 0, 1, layout.micro_batch_size)[0]
    before = accelerator.memory_allocated()
    accelerator.reset_peak_memory_stats()
    loss = trainer.loss(inputs, labels, seq_idx)
    accelerator.synchronize()
    after_forward = accelerator.memory_allocated()
    trainer.backward(loss)
    accelerator.synchronize()
    peak = accelerator.max_memory_allocated()
    last = plan.model.n_layer + 2
    rank = RankShape(plan.model, layout.micro_batch_size, args.seq_length, act=2 if shape.autocast else 4)
    kept = kept_bytes(rank, 0, last + 1, last, checkpoint_interval)
    shutdown_distributed()
    return {
        "size": "tiny" if dry else size,
        "micro_batch": layout.micro_batch_size,
        "seq": args.seq_length,
        "checkpoint_interval": checkpoint_interval,
        "kept_measured": after_forward - before,
        "kept_estimated": kept,
        "peak_measured": peak - before,
        "peak_estimated": stage.activations + stage.gradients - grads + stage.buffers,
    }


def check(size: str, checkpoint_interval: int, dry: bool) -> dict:
    """`measure` as a one-rank job of its own (the environment a launcher would set), with each
    estimate's relative error against its measurement."""
    for key, value in (
        ("WORLD_SIZE", "1"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29517"),
    ):
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as scratch:
        record = measure(size, checkpoint_interval, dry, scratch)
    for key in ("kept", "peak"):
        record[f"{key}_error"] = abs(record[f"{key}_estimated"] - record[f"{key}_measured"]) / max(
            record[f"{key}_measured"], 1
        )
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="130m", help="mamba2 size: launch/configs and launch/models mamba2-<size>.json")
    p.add_argument("--checkpoint-activations-interval", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.2)
    p.add_argument("--dry-run", action="store_true", help="the CPU, the tiny model: the code path only")
    args = p.parse_args(argv)
    record = check(args.size, args.checkpoint_activations_interval, args.dry_run)
    print(json.dumps(record), flush=True)
    return 0 if args.dry_run or max(record["kept_error"], record["peak_error"]) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
