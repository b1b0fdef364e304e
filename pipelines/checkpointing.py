"""A trainer's whole state to and from a layout-free checkpoint, at any (dp, tp, pp) and either engine.

Saving (collective, every rank): each rank takes its stage's parameters as full tensors under
mamba_ssm's names (gathered over TP; under ZeRO the fp32 masters and Adam moments gathered over DP
from the partitions: tensor collectives on the accelerator). Global rank 0 creates the staging
directory and broadcasts its path; each stage's representative (dp 0, cp 0, tp 0: context-parallel
ranks hold the same parameters) writes its stage's model and optimizer shards there itself, and
every rank its RNG file (megamamba.checkpoint.writer).
Object collectives carry only the path, each rank's file records (size, sha256) and the outcome:
rank 0 writes the rest and the manifest, commits atomically, and every rank returns or raises with
it. Rank 0 holds no more than its own stage's state.

Locking (collective, at start-up): `lock_save_dir` has global rank 0 take --save's lock for the
job's life; a second job fails on every rank with the holder's name.

Loading (collective): global rank 0 resolves `--load` and verifies the checksums, every rank opens
the same checkpoint, checks the model config, reads only its stage's tensors and cuts its TP slice
and ZeRO partition out of them; optimizer state lands where torch's AdamW keeps it (the
parameter's device and dtype; `step` on the device when fused). The data position is the
consumed-sample count the trainer records in `extra` (megamamba.checkpoint.run_record), not the
step. Optimizers handled: torch AdamW as the engine's optimizer (no ZeRO) and DeepSpeed's ZeRO-1/2
optimizer over it; anything else is refused before training.

Test hook: MEGAMAMBA_TEST_KILL_SAVE="STEP:N" makes every rank SIGKILL itself at its own N-th file
primitive (write, fsync of a directory, rename, delete) of the save of STEP: ranks write their RNG
file, stage representatives their shards, rank 0 also the staging directory, manifest and commit.
"""
import os
import signal
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megamamba.checkpoint import (
    Checkpoint,
    CheckpointError,
    NoCheckpointError,
    adam_step,
    begin,
    capture_rng,
    check_optimizer_groups,
    check_save_dir,
    files,
    finish,
    load_optimizer_tensors,
    load_scheduler_state,
    optimizer_groups,
    optimizer_tensors,
    resolve_load,
    restore_rng,
    scheduler_state,
    write_rng,
    write_stage,
)
from megamamba.checkpoint.lock import SaveDirLock, describe
from megamamba.checkpoint.store import JOB_TOKEN, checkpoint_tags
from megamamba.config import MambaConfig
from megamamba.parallel import full_key, full_tensors, local_shard
from megamamba.pipelines.names import EMBEDDING, load_full_state, to_mamba

MOMENTS = ("exp_avg", "exp_avg_sq")
KILL_HOOK = "MEGAMAMBA_TEST_KILL_SAVE"
_PRIMITIVES = ("write_file", "write_tensors", "write_bytes", "sync_dir", "rename", "remove_tree")


def _zero(trainer):
    """DeepSpeed's ZeRO-1/2 optimizer of the trainer, None when the engine steps torch's AdamW itself."""
    optimizer = trainer.engine.optimizer
    if isinstance(optimizer, torch.optim.AdamW):
        return None
    if hasattr(optimizer, "bit16_groups") and hasattr(optimizer, "single_partition_of_fp32_groups"):
        return optimizer
    raise CheckpointError(f"checkpoints support torch AdamW without ZeRO and DeepSpeed's ZeRO-1/2 optimizer, not "
                          f"{type(optimizer).__name__} (ZeRO-3 or a bf16 optimizer wrapper): run without --save/--load")


def check_trainer(trainer) -> None:
    """CheckpointError before training when the trainer's optimizer cannot be checkpointed."""
    _zero(trainer)


def _rename(trainer, config: MambaConfig):
    """Module full parameter name -> mamba_ssm name (the pipeline's layer names are mapped)."""
    if isinstance(trainer.engine, PipelineEngine):
        return lambda name: to_mamba(name, config)
    return lambda name: name


def _link_moments(zero) -> None:
    """Link ZeRO's flat Adam moments to each parameter (DeepSpeed 0.19.8 links only the first group by itself)."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for lp_group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(lp_group, flat, zero.optimizer.state)


def _gather_full(trainer, select) -> dict:
    """Full tensors of this stage by module full name: `select(param)` gathered over TP."""
    if trainer.tp is not None:
        return full_tensors(trainer.module, trainer.tp, select=select)
    return {full_key(n, p): select(p) for n, p in trainer.module.named_parameters()}


def stage_state(trainer, config: MambaConfig, keep: bool = True) -> tuple:
    """(parameters, optimizer tensors, optimizer groups) of this rank's stage under mamba_ssm names.

    Collective over TP (and DP under ZeRO). keep: return host copies (the stage's writer); False
    takes part in the gathers and returns empty dicts, so only writers hold the stage on the host.
    """
    rename = _rename(trainer, config)
    zero = _zero(trainer)
    if zero is None:
        params = _gather_full(trainer, lambda p: p.detach())
        optimizer = optimizer_tensors(trainer.engine.optimizer, trainer.module, trainer.tp)
        groups = optimizer_groups(trainer.engine.optimizer, trainer.module)
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = _gather_full(trainer, safe_get_full_fp32_param)
        optimizer = {}
        steps = {s["step"].item() for s in zero.optimizer.state.values() if "step" in s}
        if steps:
            _link_moments(zero)
            for key in MOMENTS:
                gathered = _gather_full(trainer, lambda p, key=key: safe_get_full_optimizer_state(p, key))
                optimizer.update({f"{n}/{key}": t for n, t in gathered.items()})
            (step,) = steps
            optimizer.update({f"{n}/step": torch.tensor(step, dtype=torch.float32) for n in params})
        groups = optimizer_groups(zero.optimizer, trainer.module, members=zero.bit16_groups)
    if not keep:
        return {}, {}, []

    def mamba(name: str) -> str:  # "<parameter>/<state key>"
        base, _, key = name.rpartition("/")
        return f"{rename(base)}/{key}"

    groups = [{**g, "params": [rename(n) for n in g["params"]]} for g in groups]
    return ({rename(n): t.detach().cpu().clone() for n, t in params.items()},
            {mamba(n): t.detach().cpu().clone() for n, t in optimizer.items()}, groups)


def _install_kill_hook(step: int) -> None:
    spec = os.environ.get(KILL_HOOK)
    if not spec or int(spec.split(":")[0]) != step:
        return
    at, calls = int(spec.split(":")[1]), []
    for name in _PRIMITIVES:
        original = getattr(files, name)

        def primitive(*args, _original=original, **kwargs):
            calls.append(1)
            if len(calls) == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(*args, **kwargs)

        setattr(files, name, primitive)


def _outcome(fn) -> tuple:
    """("ok", fn()) or ("error", message) for a CheckpointError or OSError, to share with the other ranks."""
    try:
        return "ok", fn()
    except (CheckpointError, OSError) as e:
        return "error", f"rank {dist.get_rank()}: {e}"


def _shared(outcome: tuple):
    """Rank 0's outcome on every rank (collective): its value, or CheckpointError with its message."""
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _write_part(trainer, staging: str, rank: int, part: Optional[tuple]) -> dict:
    """This rank's files of a save: its stage's (params, optimizer, groups) when it writes the stage, its RNG state."""
    records = {}
    if part is not None:
        records = write_stage(staging, trainer.groups.pipe_rank, trainer.groups.pipeline_parallel_size, *part)
    return records | write_rng(staging, rank, capture_rng())


def save(trainer, config: MambaConfig, save_dir: str, step: int, *, scheduler, extra: dict, tokenizer=None,
         keep_last: Optional[int] = None, protect: Optional[str] = None) -> Optional[str]:
    """Write the checkpoint after `step` optimizer steps (collective); its path on global rank 0, else None.

    protect: the tag of a checkpoint that `keep_last` retention must keep (the last good one).

    CheckpointError on every rank, with the same message, when any rank failed to write its part.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = trainer.dp_rank == 0 and trainer.groups.context_rank == 0 and trainer.groups.tensor_rank == 0
    params, optimizer, groups = stage_state(trainer, config, keep=writer)
    if trainer.groups.pipe_rank > 0:  # a tied embedding lives on the last stage too: the first stage writes it
        params.pop(EMBEDDING, None)
        optimizer = {k: t for k, t in optimizer.items() if k.rpartition("/")[0] != EMBEDDING}
    _install_kill_hook(step)
    staging = _shared(_outcome(lambda: begin(save_dir, step, keep_last)) if rank == 0 else None)

    part = (params, optimizer, groups) if writer else None
    del params, optimizer  # held by `part` alone
    mine = _outcome(partial(_write_part, trainer, staging, rank, part))
    del part  # on disk now: rank 0 finishes without its stage's host copies
    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    outcome = None
    if rank == 0:
        errors = [value for kind, value in parts if kind == "error"]
        records = {file: entry for kind, value in parts if kind == "ok" for file, entry in value.items()}
        more = f" (and {len(errors) - 1} more ranks failed)" if len(errors) > 1 else ""
        outcome = ("error", errors[0] + more) if errors else _outcome(lambda: finish(
            save_dir, staging, step, config, records, scheduler=scheduler_state(scheduler), extra=extra,
            tokenizer=tokenizer if hasattr(tokenizer, "save") else None, keep_last=keep_last, protect=protect))
    path = _shared(outcome)
    return path if rank == 0 else None


def lock_save_dir(save_dir: str) -> Optional[SaveDirLock]:
    """Global rank 0 takes the save directory's lock for the job's life (collective); the lock on rank 0.

    CheckpointError on every rank, naming the holder, when another job holds it. Call before
    anything reads or writes the directory; release it (rank 0) when the job ends.
    """
    lock = SaveDirLock(save_dir, JOB_TOKEN) if dist.get_rank() == 0 else None
    previous = _shared(_outcome(lock.acquire) if lock else None)
    if previous and dist.get_rank() == 0:
        print(f"train.py: note: took over the lock of {save_dir} from a job that did not release it: "
              f"{describe(previous)}", flush=True)
    return lock


def open_for_run(load: Optional[str], save_dir: Optional[str], config: MambaConfig) -> Optional[Checkpoint]:
    """The checkpoint to resume from (collective), None to start afresh.

    Global rank 0 resolves `load` and verifies every checksum; every rank then opens the same path.
    `--load auto` with no checkpoint under --save yet starts afresh (a first start and a requeue use
    the same command), and so does `--load D --save D` with no checkpoint in D yet (Megatron's habit),
    with a warning. CheckpointError (same message on every rank) for anything unusable.
    """
    if not load:
        return None
    answer = None
    if dist.get_rank() == 0:
        try:
            answer = ("ok", ("path", resolve_load(load, save_dir)))
        except NoCheckpointError as e:
            answer = ("ok", ("none", f"--load auto: nothing to resume ({e})")) if load == "auto" else ("error", str(e))
        except CheckpointError as e:
            answer = ("error", str(e))
            if save_dir and os.path.realpath(load) == os.path.realpath(save_dir) and not checkpoint_tags(save_dir):
                answer = ("ok", ("none", f"warning: --load {load} is the --save directory and holds no checkpoint "
                                         "yet"))
    kind, value = _shared(answer)
    if kind == "none":
        if dist.get_rank() == 0:
            print(f"train.py: {value}; starting from step 0", flush=True)
        return None
    checkpoint = Checkpoint(value, hashes=False)
    checkpoint.check_config(config)
    return checkpoint


def _local(trainer, full: torch.Tensor, param) -> torch.Tensor:
    shard = getattr(param, "tp_shard", None)
    if trainer.tp is not None and shard is not None and full.dim() > 0:
        return local_shard(full, shard, trainer.tp.size, trainer.tp.rank)
    return full


def load(trainer, checkpoint: Checkpoint, config: MambaConfig, load_optim: bool = True, load_rng: bool = True) -> int:
    """Restore parameters, masters, optimizer state, scheduler and RNG of this rank; returns the step.

    load_optim False (Megatron's --no-load-optim): the weights only; optimizer state and LR schedule
    stay fresh (moments zero, scheduler at its step 0). load_rng False (--no-load-rng): the RNG states
    stay as they are. The step count continues either way.
    """
    rename = _rename(trainer, config)
    names = {full_key(n, p): rename(full_key(n, p)) for n, p in trainer.module.named_parameters()}
    mine = sorted(set(names.values()))
    params = checkpoint.model_tensors(mine)
    optimizer = checkpoint.optimizer_tensors(mine) if load_optim else {}
    saved_groups = [{**g, "params": [n for n in g["params"] if n in names.values()]}
                    for g in checkpoint.optimizer_groups] if load_optim else None
    load_full_state(trainer.module, params, trainer.tp, rename)
    zero = _zero(trainer)
    if zero is not None:
        _load_zero(trainer, zero, optimizer, saved_groups, names)
    elif load_optim:
        inverse = {m: n for n, m in names.items()}
        tensors = {}
        for key, t in optimizer.items():
            name, _, state_key = key.rpartition("/")
            tensors[f"{inverse[name]}/{state_key}"] = t
        saved_groups = [{**g, "params": [inverse[n] for n in g["params"]]} for g in saved_groups]
        load_optimizer_tensors(trainer.engine.optimizer, trainer.module, tensors, saved_groups, trainer.tp)
    if load_optim:
        _restore_scheduler(trainer.lr_scheduler, checkpoint.scheduler, checkpoint.step)
    if load_rng:
        restore_rng(checkpoint.rng_state(dist.get_rank(), dist.get_world_size()))
    trainer.engine.global_steps = checkpoint.step
    return checkpoint.step


def _restore_scheduler(scheduler, state: Optional[dict], step: int) -> None:
    """The saved scheduler position (epoch) under the run's schedule: base LRs stay the run's peak, so the
    group LRs are the run's schedule at the saved epoch (the saved ones, unless the plan was overridden).
    A checkpoint without scheduler state (saved by the single-process API without one): epoch `step`."""
    load_scheduler_state(scheduler, state, step)
    scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]
    lrs = [base * rule(scheduler.last_epoch) for rule, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _load_zero(trainer, zero, optimizer: dict, saved_groups: Optional[list], names: dict) -> None:
    """ZeRO: fresh flat Adam state at the saved step, linked, then each parameter's master and moments set.

    saved_groups None: no optimizer state is loaded (`optimizer` empty), only the masters are set.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if saved_groups is not None:
        run_groups = optimizer_groups(zero.optimizer, trainer.module, members=zero.bit16_groups)
        check_optimizer_groups(saved_groups, [{**g, "params": [names[n] for n in g["params"]]} for g in run_groups])
    steps = {t.item() for k, t in optimizer.items() if k.endswith("/step")}
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint optimizer holds different step counts {sorted(steps)}; ZeRO keeps one")
    for flat in zero.single_partition_of_fp32_groups if steps else ():
        group = next(g for g in zero.optimizer.param_groups if any(p is flat for p in g["params"]))
        zero.optimizer.state[flat] = {"step": adam_step(next(iter(steps)), flat, group),
                                      "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    if steps:
        _link_moments(zero)
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            safe_set_full_fp32_param(p, p.detach().float())
            key = names[full_key(name, p)]
            for moment in MOMENTS if steps else ():
                safe_set_full_optimizer_state(p, _local(trainer, optimizer[f"{key}/{moment}"], p), moment)


def check_flags(save: Optional[str], load: Optional[str], save_interval: int, keep_last: Optional[int]) -> None:
    """Start-up checks of the checkpoint flags (no process group needed): CheckpointError with one message.

    An unusable --save fails here, in seconds, not at the first save.
    """
    if save_interval < 0:
        raise CheckpointError(f"--save-interval {save_interval}: must be >= 0 (0: save only at the end)")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"--keep-last {keep_last}: must be >= 1 (omit it to keep every checkpoint)")
    if load == "auto" and not save:
        raise CheckpointError("--load auto: resumes from the newest checkpoint under --save, but --save is not set")
    if save:
        check_save_dir(save)


def save_due(steps_done: int, train_iters: int, save_interval: int, stopping: bool) -> bool:
    """Whether to checkpoint after `steps_done` steps: at the interval, at the end, when stopping."""
    return stopping or steps_done == train_iters or bool(save_interval and steps_done % save_interval == 0)
