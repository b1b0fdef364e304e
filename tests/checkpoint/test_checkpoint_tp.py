"""Checkpoints do not depend on the tensor-parallel size: saved at TP 2, resumed at TP 2 and at TP 1, and back.

On two spawned gloo ranks a TP-2 run trains 2 steps, gathers its parameters and optimizer state
to full tensors (`model_tensors` / `optimizer_tensors` with `tp`), rank 0 writes them as the only
writer and each rank its RNG state (the writer's steps), and the run goes
on 2 steps. A fresh TP-2 run (another seed) loads the checkpoint: its next 2 losses,
shards and optimizer state are bit-identical to the uninterrupted run's. The single process
then resumes the same checkpoint at TP 1 (and the ranks resume a TP-1 checkpoint at TP 2): the
loss curves agree to float32 reduction-order error (<= 1e-5 relative; TP sums in another order).
Mamba-2 with one B/C group exercises the replicated in_proj/conv partners of the sharded parameters.
"""

import pytest
import torch
import torch.distributed as dist

from checkpoint_fixtures import tiny, train_step, training_run
from distributed import run_ranks
from megamamba.checkpoint import (
    Checkpoint,
    begin,
    capture_rng,
    finish,
    load_model_tensors,
    load_optimizer_tensors,
    load_scheduler_state,
    load_training_checkpoint,
    model_tensors,
    optimizer_groups,
    optimizer_tensors,
    restore_rng,
    save_training_checkpoint,
    scheduler_state,
    whole,
    write_rng,
    write_shard,
)
from megamamba.parallel import TensorParallel
from megamamba.testing.numerics import relative_error

pytestmark = pytest.mark.slow

CONFIGS = {"mamba2_one_group": tiny("Mamba2", ssm={"ngroups": 1}), "mamba1": tiny("Mamba1")}
SAVE_AT, STEPS = 2, 4


def resume_tp(run, ckpt: Checkpoint, tp) -> None:
    model, optimizer, scheduler = run
    ckpt.check_config(model.config)
    load_model_tensors(model, ckpt.model_tensors(), tp)
    load_optimizer_tensors(optimizer, model, ckpt.optimizer_tensors(), ckpt.optimizer_groups, tp)
    load_scheduler_state(scheduler, ckpt.scheduler, ckpt.step)
    restore_rng(ckpt.rng_state(dist.get_rank(), dist.get_world_size()))


def tp_ranks(case: str, save_dir: str, tp1_checkpoint: str) -> dict:
    rank = dist.get_rank()
    tp = TensorParallel(dist.group.WORLD, 2, rank)
    config = CONFIGS[case]
    run = training_run(config, seed=0, tp=tp)
    losses = [train_step(*run, s) for s in range(SAVE_AT)]
    model, optimizer, scheduler = run
    full = model_tensors(model, tp)
    state = optimizer_tensors(optimizer, model, tp)
    staging = [begin(save_dir, SAVE_AT) if rank == 0 else None]
    dist.broadcast_object_list(staging, src=0)
    records = write_rng(staging[0], rank, capture_rng())
    if rank == 0:
        records.update(write_shard(staging[0], None, whole(full), whole(state), optimizer_groups(optimizer, model)))
    parts = [None, None] if rank == 0 else None
    dist.gather_object(records, parts, dst=0)
    if rank == 0:
        finish(save_dir, staging[0], SAVE_AT, config, parts[0] | parts[1], scheduler=scheduler_state(scheduler))
    dist.barrier()
    losses += [train_step(*run, s) for s in range(SAVE_AT, STEPS)]

    resumed = training_run(config, seed=5, tp=tp)
    resume_tp(resumed, Checkpoint(f"{save_dir}/step_{SAVE_AT:06d}"), tp)
    resumed_losses = losses[:SAVE_AT] + [train_step(*resumed, s) for s in range(SAVE_AT, STEPS)]
    same_shards = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed[0].parameters()))
    same_state = all(
        torch.equal(optimizer.state[a][k], resumed[1].state[b][k])
        for a, b in zip(model.parameters(), resumed[0].parameters())
        for k in ("exp_avg", "exp_avg_sq", "step")
    )

    from_tp1 = training_run(config, seed=6, tp=tp)
    resume_tp(from_tp1, Checkpoint(tp1_checkpoint), tp)
    from_tp1_losses = [train_step(*from_tp1, s) for s in range(SAVE_AT, STEPS)]
    return {
        "losses": losses,
        "resumed": resumed_losses,
        "same_shards": same_shards,
        "same_state": same_state,
        "from_tp1": from_tp1_losses,
    }


@pytest.mark.parametrize("case", CONFIGS)
def test_checkpoints_resume_across_tensor_parallel_sizes(tmp_path, case):
    config = CONFIGS[case]
    tp1 = training_run(config, seed=0)
    tp1_losses = [train_step(*tp1, s) for s in range(SAVE_AT)]
    tp1_checkpoint = save_training_checkpoint(str(tmp_path / "tp1"), SAVE_AT, *tp1)
    tp1_losses += [train_step(*tp1, s) for s in range(SAVE_AT, STEPS)]

    results = run_ranks(tp_ranks, 2, args=(case, str(tmp_path / "tp2"), tp1_checkpoint), timeout=300)
    r = results[0]
    assert results[0]["losses"] == results[1]["losses"]
    assert r["resumed"] == r["losses"], "TP 2 -> TP 2 resume is not bit-identical"
    assert r["same_shards"] and r["same_state"] and results[1]["same_shards"] and results[1]["same_state"]

    at_tp1 = training_run(config, seed=9)
    load_training_checkpoint(Checkpoint(str(tmp_path / "tp2" / f"step_{SAVE_AT:06d}")), *at_tp1)
    tp2_to_tp1 = [train_step(*at_tp1, s) for s in range(SAVE_AT, STEPS)]
    errors = {
        "tp2 vs tp1 curve": relative_error(r["losses"], tp1_losses),
        "tp2 -> tp1 resume": relative_error(tp2_to_tp1, r["losses"][SAVE_AT:]),
        "tp1 -> tp2 resume": relative_error(r["from_tp1"], tp1_losses[SAVE_AT:]),
    }
    print(case, {k: f"{v:.1e}" for k, v in errors.items()})
    assert all(v <= 1e-5 for v in errors.values()), errors
