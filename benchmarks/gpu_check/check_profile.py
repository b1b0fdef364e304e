"""The GPU check's profile section: one training step of our model under torch.profiler.

MambaLM at a size, one micro-batch of that size's DeepSpeed config at seq 2048, bf16 autocast, fused
AdamW and clipping (check_train.train_step), after two warm-up steps. The operator table by device time
goes to <out>/profile_<size>.txt; the leading kernels by device time go to results.jsonl, each with its
share of the step's kernel time, beside the step's wall time (timed apart from the profiled step).
The dry run profiles the tiny model on the CPU, by operators' CPU time.
"""

import json
import os
import time

import torch

from check_train import model_paths, train_step

ROWS = 20  # operators recorded


def profile_step(results, out: str, size: str, dry: bool) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from megamamba import MambaConfig, MambaLM

    device = torch.device("cpu" if dry else "cuda")
    ds_config, model_config = model_paths(size, dry)
    with open(ds_config) as f:
        micro = json.load(f)["train_micro_batch_size_per_gpu"]
    config = MambaConfig.from_json(model_config)
    seq = 64 if dry else 2048
    torch.manual_seed(0)
    model = MambaLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not dry)
    ids = torch.randint(0, config.vocab_size, (micro, seq + 1), device=device)
    step = lambda: train_step(model, optimizer, ids[:, :-1], ids[:, 1:], config.vocab_size)  # noqa: E731
    for _ in range(2):
        step()
    sync = (lambda: None) if dry else torch.cuda.synchronize
    sync()
    start = time.perf_counter()
    step()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    activities = [ProfilerActivity.CPU] + ([] if dry else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        step()
    key = "self_cpu_time_total" if dry else "self_device_time_total"
    averages = prof.key_averages()
    path = os.path.join(out, f"profile_{size.replace('.', '_')}.txt")
    with open(path, "w") as f:
        f.write(averages.table(sort_by=key, row_limit=60))
    # On the GPU an operator's self device time repeats its kernels' own: rows and total are the kernels'.
    timed = [e for e in averages if dry or e.device_type != DeviceType.CPU]
    total = sum(getattr(e, key) for e in timed)
    for e in sorted(timed, key=lambda e: getattr(e, key), reverse=True)[:ROWS]:
        results.write(
            "profile_op",
            size=size,
            op=e.key,
            calls=e.count,
            self_ms=getattr(e, key) / 1e3,
            share=getattr(e, key) / total,
        )
    results.write(
        "profile",
        size=size,
        micro_batch=micro,
        seq=seq,
        wall_ms=wall_ms,
        self_total_ms=total / 1e3,
        table=path,
        by="operators' CPU time" if dry else "kernels' device time",
    )
