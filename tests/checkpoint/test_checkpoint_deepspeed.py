"""The layout-free checkpoint through DeepSpeed's ZeRO-1 optimizer: the recipe the trainer follows.

`zero_state` gathers each parameter's fp32 master weight and Adam moments from the ZeRO partitions
(deepspeed.utils.safe_get_full_*, collective over data parallel), `load_zero_state` scatters them
back. Two DeepSpeed 0.19.8 details: the ZeRO optimizer links its moments to the parameters only
for the groups stepped before the first link (with two param groups the second stays unlinked),
and a fresh engine has no moments until its first step; so both sides (re)link explicitly, and
loading creates the flat AdamW state first.

Measured: saved at dp 2 after 2 steps, a fresh dp-2 engine resumes bit-identically; a dp-1 engine
resumes the same checkpoint within float32 reduction-order error of the dp-2 curve.
"""

import os
import sys

import pytest
import torch

from checkpoint_fixtures import SEQ, tiny
from distributed import run_ranks
from megamamba.testing.numerics import relative_error

pytestmark = pytest.mark.slow

GLOBAL_BATCH, MICRO = 4, 2
SAVE_AT, STEPS = 2, 4


def engine(seed: int, dp: int):
    import deepspeed

    from megamamba import MambaLM
    from megamamba.optim import param_groups
    from megamamba.schedule.lr_schedule import LRSchedule

    torch.manual_seed(seed)
    module = MambaLM(tiny("Mamba2"))
    optimizer = torch.optim.AdamW(param_groups(module, 0.1), lr=1e-2)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL_BATCH // MICRO // dp,
        "zero_optimization": {"stage": 1},
    }
    return deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, lr_scheduler=LRSchedule(1e-2, 1e-3, 2, 8).scheduler
    )[0]


def train_step(eng, step: int, rank: int, dp: int) -> float:
    import torch.distributed as dist

    ids = torch.randint(0, 37, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    rows = ids.chunk(dp)[rank]
    losses = []
    for micro in rows.split(MICRO):
        loss = eng(micro[:, :-1], micro[:, 1:])
        eng.backward(loss)
        eng.step()
        losses.append(loss.detach())
    total = torch.stack(losses).mean()
    dist.all_reduce(total)
    return (total / dp).item()


def link_moments(eng) -> None:
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    zero = eng.optimizer
    for lp_group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(lp_group, flat, zero.optimizer.state)


def zero_state(eng) -> tuple:
    """(full fp32 parameters, optimizer tensors "<name>/<key>", groups) by mamba_ssm name, on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megamamba.checkpoint import optimizer_groups

    link_moments(eng)
    named = dict(eng.module.named_parameters())
    (step,) = {s["step"].item() for s in eng.optimizer.optimizer.state.values()}
    params = {n: safe_get_full_fp32_param(p).cpu() for n, p in named.items()}
    state = {
        f"{n}/{k}": safe_get_full_optimizer_state(p, k).cpu()
        for n, p in named.items()
        for k in ("exp_avg", "exp_avg_sq")
    }
    state.update({f"{n}/step": torch.tensor(step) for n in named})
    return params, state, optimizer_groups(eng.optimizer.optimizer, eng.module, members=eng.optimizer.bit16_groups)


def load_zero_state(eng, ckpt) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from megamamba.checkpoint import check_optimizer_groups, load_scheduler_state, optimizer_groups

    params, state = ckpt.model_tensors(), ckpt.optimizer_tensors()
    zero = eng.optimizer
    check_optimizer_groups(ckpt.optimizer_groups, optimizer_groups(zero.optimizer, eng.module, zero.bit16_groups))
    (step,) = {t.item() for k, t in state.items() if k.endswith("/step")}
    for flat in zero.single_partition_of_fp32_groups:
        zero.optimizer.state[flat] = {
            "step": torch.tensor(step),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    link_moments(eng)
    with torch.no_grad():
        for n, p in eng.module.named_parameters():
            p.copy_(params[n])
            safe_set_full_fp32_param(p, params[n])
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[f"{n}/{k}"], k)
    load_scheduler_state(eng.lr_scheduler, ckpt.scheduler, ckpt.step)


def zero_ranks(save_dir: str, dp: int, extensions_dir: str) -> dict:
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    import torch.distributed as dist

    from megamamba.checkpoint import Checkpoint, save_checkpoint, scheduler_state
    from megamamba.parallel.groups import init_distributed

    init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    path = os.path.join(save_dir, f"step_{SAVE_AT:06d}")
    if dp == 1:  # resume the dp-2 checkpoint
        eng = engine(seed=3, dp=1)
        load_zero_state(eng, Checkpoint(path))
        return {"resumed": [train_step(eng, s, rank, dp) for s in range(SAVE_AT, STEPS)]}
    eng = engine(seed=0, dp=dp)
    losses = [train_step(eng, s, rank, dp) for s in range(SAVE_AT)]
    params, state, groups = zero_state(eng)
    if rank == 0:
        save_checkpoint(
            save_dir,
            SAVE_AT,
            tiny("Mamba2"),
            params,
            optimizer=state,
            optimizer_groups=groups,
            scheduler=scheduler_state(eng.lr_scheduler),
        )
    dist.barrier()
    losses += [train_step(eng, s, rank, dp) for s in range(SAVE_AT, STEPS)]
    fresh = engine(seed=3, dp=dp)
    load_zero_state(fresh, Checkpoint(path))
    return {"losses": losses, "resumed": [train_step(fresh, s, rank, dp) for s in range(SAVE_AT, STEPS)]}


def test_zero1_checkpoint_resumes_exactly_at_the_same_dp_and_closely_at_another(tmp_path):
    pytest.importorskip("deepspeed")
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    dp2 = run_ranks(zero_ranks, 2, args=(str(tmp_path), 2, extensions), init_process_group=False, timeout=300)[0]
    assert dp2["resumed"] == dp2["losses"][SAVE_AT:], dp2
    dp1 = run_ranks(zero_ranks, 1, args=(str(tmp_path), 1, extensions), init_process_group=False, timeout=300)[0]
    ref = torch.tensor(dp2["losses"][SAVE_AT:], dtype=torch.float64)
    got = torch.tensor(dp1["resumed"], dtype=torch.float64)
    assert torch.isfinite(got).all()
    err = relative_error(got, ref)
    print(f"dp 2 -> dp 1 resume: relative loss error {err:.1e}")
    assert err <= 1e-5, (dp1, dp2)
