"""The GPU check's training sections.

nccl_smoke  `deepspeed --num_gpus 1 launch/train.py`: 6 steps of the 130M model (seq 2048, micro-batch
            2, bf16 autocast, ZeRO-1) saving at steps 3 and 6, then a second run resumed from step 3's
            checkpoint (saving again at its end); its losses at steps 3-5 must repeat the first run's.
throughput  per size: launch/train.py as one rank (benchmarks/train.py's run), then mamba_ssm's
            MambaLMHeadModel with torch AMP on the same batch split, in this process. Ours also records
            its start-up memory plan (total and activations, read from its log) beside the measured
            peak, which is how the plan's activation estimate is checked on the GPU.
parity      our MambaLM and mamba_ssm's from the same initial weights (ours loaded into theirs, same
            state-dict keys), the same batches of the built-in corpus, the same plain loop (bf16
            autocast, fused AdamW, clipping 1.0): both losses at each of 20 steps and their relative
            difference. It compares the models and kernels; our engine's numbers are the smoke's.
The dry run uses the tiny CPU model and DeepSpeed config, and our model as mamba_ssm's stand-in.
"""

import json
import os
import re

import torch
import torch.nn.functional as F

from check_io import load_benchmark
from megamamba.testing.processes import run_logged

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_PY = os.path.join(REPO, "launch", "train.py")
SMOKE_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1},
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
}


def model_paths(size: str, dry: bool):
    """(DeepSpeed config, model config) of a size; the tiny CPU pair in the dry run."""
    if dry:
        return os.path.join(REPO, "launch/configs/tiny-cpu.json"), os.path.join(REPO, "launch/models/tiny-mamba2.json")
    return (
        os.path.join(REPO, f"launch/configs/mamba2-{size}.json"),
        os.path.join(REPO, f"launch/models/mamba2-{size}.json"),
    )


def read_losses(path: str) -> dict:
    """step -> loss of a --metrics-jsonl file (complete lines only)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in (json.loads(line) for line in f if line.endswith("\n"))}


def nccl_smoke(results, out, scratch, dry, timeout):
    """Two launcher runs, the second resumed from the first's step-3 checkpoint; one record per run and
    one comparing the losses of the steps both ran. Checkpoints go under `scratch`, logs to `out`."""
    work = os.path.join(scratch, "nccl_smoke")
    os.makedirs(work, exist_ok=True)
    ds_config, model_config = model_paths("130m", dry)
    if not dry:
        ds_config = os.path.join(work, "ds_config.json")
        with open(ds_config, "w") as f:
            json.dump(SMOKE_DS_CONFIG, f)
    steps, seq = 6, 64 if dry else 2048
    common = [
        "deepspeed",
        "--num_gpus",
        "1",
        TRAIN_PY,
        "--deepspeed_config",
        ds_config,
        "--model-config",
        model_config,
        "--train-iters",
        str(steps),
        "--seq-length",
        str(seq),
        "--log-interval",
        "1",
    ]
    first = common + [
        "--metrics-jsonl",
        os.path.join(work, "first.jsonl"),
        "--save",
        os.path.join(work, "ckpt"),
        "--save-interval",
        "3",
    ]
    status = run_logged(first, os.path.join(out, "nccl_smoke_first.log"), timeout / 2, cwd=work)
    losses = read_losses(os.path.join(work, "first.jsonl"))
    results.write("smoke_run", run="first", **status, steps=sorted(losses), losses=losses)
    tags = (
        sorted(t for t in os.listdir(os.path.join(work, "ckpt")) if t.startswith("step_"))
        if os.path.isdir(os.path.join(work, "ckpt"))
        else []
    )
    if status["rc"] != 0 or not tags:
        results.write("resume", ok=False, error=f"first run exit {status['rc']}, checkpoints {tags}")
        return
    resumed = common + [
        "--metrics-jsonl",
        os.path.join(work, "resumed.jsonl"),
        "--load",
        os.path.join(work, "ckpt", tags[0]),
        "--save",
        os.path.join(work, "ckpt_resumed"),
    ]
    status = run_logged(resumed, os.path.join(out, "nccl_smoke_resumed.log"), timeout / 2, cwd=work)
    again = read_losses(os.path.join(work, "resumed.jsonl"))
    results.write("smoke_run", run="resumed", **status, steps=sorted(again), losses=again)
    both = sorted(set(losses) & set(again))
    diff = max((abs(again[s] - losses[s]) / abs(losses[s]) for s in both), default=None)
    saved = os.path.isdir(os.path.join(work, "ckpt_resumed"))
    ok = status["rc"] == 0 and bool(both) and min(again) == both[0] > 0 and diff <= 1e-2 and saved
    results.write(
        "resume",
        ok=ok,
        resumed_from=tags[0],
        first_step=min(again, default=None),
        steps_compared=both,
        max_rel_loss_diff=diff,
        saved_again=saved,
    )


def planned_memory(log: str) -> dict:
    """The memory plan train.py printed at start-up (GiB per rank of the largest stage): total, activations."""
    plan = {}
    with open(log, errors="replace") as f:
        for line in f:
            if line.startswith("memory plan"):
                for key, name in (("planned_total_gb", "total"), ("planned_activations_gb", "activations")):
                    match = re.search(rf"\b{name} (\d+\.\d+)", line)
                    if match:
                        plan[key] = float(match.group(1))
    return plan


def throughput(results, out, size, dry, theirs, timeout):
    """Ours (launch/train.py, one rank) then theirs (this process) at one size; one record each."""
    train_bench = load_benchmark("train")
    ds_config, model_config = model_paths(size, dry)
    steps, warmup, seq = (2, 1, 64) if dry else (5, 2, 2048)
    peak = train_bench.H200_PEAK_TFLOPS
    log = os.path.join(out, f"throughput_{size}_ours.log")
    ours = train_bench.train_ours(ds_config, model_config, steps, warmup, seq, peak, log=log, timeout=timeout * 0.6)
    if os.path.exists(log):
        ours.update(planned_memory(log))
    results.write(
        "throughput", size=size, engine="ours (DeepSpeed ZeRO-1, bf16 autocast)", seq=seq, steps=steps, **ours
    )
    if theirs is None:
        return
    try:
        res = train_bench.train_mamba_ssm(
            (theirs.MambaLMHeadModel, theirs.MambaConfig),
            ds_config,
            model_config,
            steps,
            warmup,
            seq,
            peak,
            device="cpu" if dry else "cuda",
        )
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: recorded
        res = {"error": repr(exc)[:500]}
    results.write("throughput", size=size, engine="mamba_ssm + torch AMP", seq=seq, steps=steps, **res)


def parity(results, dry, theirs, steps=20):
    """Losses of ours and theirs at each step from the same weights and batches; the last step's
    relative difference in a final record."""
    from megamamba import MambaConfig, MambaLM
    from megamamba.data.training_data import training_data

    device = torch.device("cpu" if dry else "cuda")
    _, model_config = model_paths("130m", dry)
    config = MambaConfig.from_json(model_config)
    micro, seq = (2, 64) if dry else (4, 2048)
    torch.manual_seed(0)
    ours = MambaLM(config).to(device)
    fields = {**config.to_dict(), "ssm_cfg": {**config.ssm_cfg, "use_mem_eff_path": False}}
    model = theirs.MambaLMHeadModel(theirs.MambaConfig(**fields), device=device, dtype=torch.float32)
    missing = model.load_state_dict(ours.state_dict(), strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        results.write(
            "parity_failed",
            error=f"state-dict keys differ: theirs lacks {missing.unexpected_keys[:5]}, "
            f"ours lacks {missing.missing_keys[:5]}",
        )
        return
    data = training_data(config, "bytes", [], [], seq, micro, 1234, reset_at_documents=False).train
    runs = {
        name: (
            m,
            torch.optim.AdamW(
                m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
            ),
        )
        for name, m in (("ours", ours), ("theirs", model))
    }
    steps = 3 if dry else steps
    for step in range(steps):
        inputs, labels, _ = data.micro_batches(step, 0, 1, micro)[0]
        inputs, labels = inputs.to(device), labels.to(device)
        losses = {name: train_step(m, opt, inputs, labels, config.vocab_size) for name, (m, opt) in runs.items()}
        rel = abs(losses["ours"] - losses["theirs"]) / abs(losses["theirs"])
        results.write("parity_step", step=step, ours=losses["ours"], theirs=losses["theirs"], rel_diff=rel)
    results.write(
        "parity",
        steps=steps,
        micro_batch=micro,
        seq=seq,
        ours=losses["ours"],
        theirs=losses["theirs"],
        rel_diff=rel,
        ok=rel <= 0.01,
    )


def train_step(model, optimizer, inputs, labels, vocab_size) -> float:
    """One bf16-autocast step of a model returning logits (ours) or an output with .logits (theirs)."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
        out = model(inputs)
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits[..., :vocab_size].float().flatten(0, 1), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
