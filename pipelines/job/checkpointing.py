"""A trainer's whole state to and from a layout-free checkpoint, at any (dp, tp, pp) and either engine.

Saving (collective, every rank): every rank writes the part of its stage's state that only it
holds (`shard_state`), under mamba_ssm's names, with no tensor collective: under ZeRO its fragment
of the fp32 masters and Adam moments (the partition it updates), without ZeRO the first data
rank's TP rows; context-parallel ranks hold the same parameters, so only ZeRO partitions them.
Global rank 0 creates the staging directory and broadcasts its path; every rank writes its files
there (megamamba.checkpoint.writer) and its RNG file. Object collectives carry only the path, each
rank's file records (size, sha256) and the outcome: rank 0 checks from the headers that every
element is stored once, writes the rest and the manifest, commits atomically, and every rank
returns or raises with it.

Locking (collective, at start-up): `lock_save_dir` has global rank 0 take --save's lock for the
job's life; a second job fails on every rank with the holder's name. Under the lock it removes dead
jobs' staging folders and refuses a directory short of one checkpoint (megamamba.checkpoint.startup).

Loading (collective): global rank 0 resolves `--load` and verifies the checksums, every rank opens
the same checkpoint, checks the model config, reads only the stored pieces its own TP slices
overlap and sets its ZeRO partition from them; optimizer state lands where torch's AdamW keeps it (the
parameter's device and dtype; `step` on the device when fused). The data position is the
consumed-sample count the trainer records in `extra` (megamamba.checkpoint.run_record), not the
step. Optimizers handled: torch AdamW as the engine's optimizer (no ZeRO) and DeepSpeed's ZeRO-1/2
optimizer over it; anything else is refused before training.
"""

import argparse
import logging
import os
import shutil
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megamamba.checkpoint import (
    Checkpoint,
    CheckpointError,
    NoCheckpointError,
    adam_step,
    begin,
    capture_rng,
    check_optimizer_groups,
    check_save_dir,
    finish,
    resolve_load,
    restore_rng,
    whole,
    write_rng,
    write_shard,
)
from megamamba.checkpoint.lock import SaveDirLock, describe
from megamamba.checkpoint.space import checkpoint_size, save_failed
from megamamba.checkpoint.startup import open_save_dir
from megamamba.checkpoint.store import JOB_TOKEN, checkpoint_tags, discard, read_latest, staging_dir, tag_for
from megamamba.checkpoint.tensor_pieces import Cut, Piece
from megamamba.config import MambaConfig
from megamamba.parallel.expert.expert_parallel import holds_split_experts
from megamamba.pipelines.deepspeed_internals import (
    fragment_range,
    fragment_values,
    is_zero_optimizer,
    link_zero_moments,
    zero_flat_masters,
    zero_fragment,
)
from megamamba.pipelines.job.finite_weights import check_finite_on_every_rank
from megamamba.pipelines.stages.names import EMBEDDING

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero(trainer):
    """DeepSpeed's ZeRO-1/2 optimizer of the trainer, None when the engine steps torch's AdamW itself."""
    optimizer = trainer.engine_optimizer()
    if isinstance(optimizer, torch.optim.AdamW):
        return None
    if is_zero_optimizer(optimizer):
        return optimizer
    raise CheckpointError(
        f"checkpoints support torch AdamW without ZeRO and DeepSpeed's ZeRO-1/2 optimizer, not "
        f"{type(optimizer).__name__} (ZeRO-3 or a bf16 optimizer wrapper): run without --save/--load"
    )


def check_trainer(trainer) -> None:
    """CheckpointError before training when the trainer's optimizer cannot be checkpointed."""
    _zero(trainer)


def _cut(param, tp) -> tuple:
    """(full shape, this rank's `Cut` of it) of a parameter's full tensor: its TP rows, or its experts."""
    shard, shape = getattr(param, "tp_shard", None), tuple(param.shape)
    if holds_split_experts(param):
        experts = param.expert_shard
        return (experts.num_experts, *shape[1:]), Cut(0, experts.rows, shape)
    if shard is None or shard.dim is None:
        return shape, Cut.whole(shape)
    size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
    full = shape[: shard.dim] + (sum(c.size for c in shard.components),) + shape[shard.dim + 1 :]
    return full, Cut(shard.dim, tuple(shard.full_rows(size, rank)), shape)


def _stage_parameters(trainer) -> list:
    """(mamba_ssm name, parameter) of this rank's stage that its checkpoint holds (a tied embedding on a later
    stage is the first stage's)."""
    return [(name, p) for _, name, p in trainer.named_parameters() if trainer.pipe_rank == 0 or name != EMBEDDING]


def shard_state(trainer) -> tuple:
    """This rank's distinct part of its stage: (parameters, optimizer state, optimizer groups) as `Held`
    entries under mamba_ssm names (optimizer state "<name>/<key>").

    Without ZeRO the first data rank writes its TP rows of each sharded tensor (a replicated one on TP
    rank 0 only), with AdamW's per-parameter state; experts split over an expert-parallel group are written by
    each rank of the first one, its own experts. Under ZeRO every data rank writes its fragment of
    the fp32 masters and Adam moments, the partition it updates (an expert's over its expert-data-parallel
    group); parameters the optimizer leaves alone
    (frozen: the expert biases of mixture-of-experts routers) have no fragment, and the first data rank
    writes them as without ZeRO. The stage's representative (first
    data rank, TP rank 0) adds the 0-d states (`step`) and the optimizer groups. No communication.
    """
    zero = _zero(trainer)
    first_data = trainer.dp_rank == 0 and trainer.context_rank == 0
    tp_first = trainer.tensor_rank == 0
    held = [
        (name, p, *_cut(p, trainer.tp))
        for name, p in _stage_parameters(trainer)
        if tp_first or (getattr(p, "tp_shard", None) is not None and p.tp_shard.sharded)
    ]
    writes = [e for e in held if (trainer.expert_data_rank == 0 if holds_split_experts(e[1]) else first_data)]
    if zero is not None:
        trained = [entry for entry in held if entry[1].requires_grad]
        params, optimizer, step = _zero_pieces(zero, trained)
        if first_data:
            params += [
                (name, Piece(name, shape, cut), p.detach()) for name, p, shape, cut in held if not p.requires_grad
            ]
        scalars = (
            {} if step is None else {f"{name}/step": torch.tensor(step, dtype=torch.float32) for name, *_ in trained}
        )
    else:
        params, optimizer, scalars = _adamw_pieces(trainer.engine_optimizer(), writes)
    if not (first_data and tp_first):
        return params, optimizer, []
    return params, optimizer + whole(scalars), trainer.optimizer_groups()


def _zero_pieces(zero, held: list) -> tuple:
    """(master pieces, moment pieces, the optimizer step or None before the first) of this rank's ZeRO
    partition, for `held` (name, parameter, full shape, cut): the fragments this rank updates."""
    steps = {s["step"].item() for s in zero.optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(
            f"ZeRO's parameter groups are at different optimizer steps {sorted(steps)}; a checkpoint records one"
        )
    if steps:
        link_zero_moments(zero)
    params, optimizer = [], []
    for name, p, shape, cut in held:
        fragment = zero_fragment(p)
        if fragment is None:  # no element of this parameter is in this rank's partition
            continue
        flat = fragment_range(fragment)
        params.append((name, Piece(name, shape, cut, flat), fragment_values(fragment)))
        optimizer += [
            (f"{name}/{key}", Piece(f"{name}/{key}", shape, cut, flat), fragment_values(fragment, key))
            for key in (MOMENTS if steps else ())
        ]
    return params, optimizer, next(iter(steps), None)


def _adamw_pieces(optimizer: torch.optim.Optimizer, held: list) -> tuple:
    """(parameter pieces, state pieces, 0-d states by "<name>/<key>") of torch AdamW for `held`
    (name, parameter, full shape, cut)."""
    params, state, scalars = [], [], {}
    for name, p, shape, cut in held:
        params.append((name, Piece(name, shape, cut), p.detach()))
        for key, value in optimizer.state.get(p, {}).items():
            state_name = f"{name}/{key}"
            if not torch.is_tensor(value) or (value.dim() and value.shape != p.shape):
                raise CheckpointError(
                    f"optimizer state {state_name} is {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))}: only tensors shaped like the "
                    f"parameter {tuple(p.shape)} or 0-d tensors can be saved"
                )
            if value.dim() == 0:
                scalars.setdefault(state_name, value.detach())
            else:
                state.append((state_name, Piece(state_name, shape, cut), value.detach()))
    return params, state, scalars


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


def _write_part(trainer, staging: str, rank: int) -> dict:
    """This rank's files of a save: its distinct part of the stage (when it has one) and its RNG state."""
    return write_shard(staging, rank, *shard_state(trainer)) | write_rng(staging, rank, capture_rng())


def save(
    trainer,
    config: MambaConfig,
    save_dir: str,
    step: int,
    *,
    extra: dict,
    tokenizer=None,
    keep_last: Optional[int] = None,
    protect: Optional[str] = None,
) -> Optional[str]:
    """Write the checkpoint after `step` optimizer steps (collective); its path on global rank 0, else None.

    protect: the tag of a checkpoint that `keep_last` retention must keep (the last good one).

    CheckpointError on every rank, with the same message, when any rank failed to write its part (a full
    disk, say): rank 0 removes what was staged, `latest` stays, and the message names --save and the bytes
    a checkpoint needs.
    Ctrl-C (KeyboardInterrupt) abandons the save: rank 0 removes its staging directory (what it can), and
    `latest` still names the previous checkpoint.
    """
    try:
        staging = _shared(_outcome(lambda: begin(save_dir, step, keep_last)) if dist.get_rank() == 0 else None)
        return _save_staged(trainer, config, save_dir, staging, step, extra, tokenizer, keep_last, protect)
    except KeyboardInterrupt:
        if dist.get_rank() == 0:  # gone already when the save had committed
            shutil.rmtree(staging_dir(save_dir, tag_for(step)), ignore_errors=True)
        raise
    except CheckpointError as e:
        if dist.get_rank() == 0:
            discard(save_dir, tag_for(step))
        size = checkpoint_size(config, dist.get_world_size())
        raise save_failed(save_dir, step, str(e), size, read_latest(save_dir)) from None


def _save_staged(
    trainer, config, save_dir: str, staging: str, step: int, extra: dict, tokenizer, keep_last, protect
) -> Optional[str]:
    """`save` once global rank 0 has made the staging directory `staging`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _outcome(partial(_write_part, trainer, staging, rank))
    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    outcome = None
    if rank == 0:
        errors = [value for kind, value in parts if kind == "error"]
        records = {file: entry for kind, value in parts if kind == "ok" for file, entry in value.items()}
        more = f" (and {len(errors) - 1} more ranks failed)" if len(errors) > 1 else ""
        outcome = (
            ("error", errors[0] + more)
            if errors
            else _outcome(
                lambda: finish(
                    save_dir,
                    staging,
                    step,
                    config,
                    records,
                    scheduler=trainer.scheduler_state(),
                    extra=extra,
                    tokenizer=tokenizer if hasattr(tokenizer, "save") else None,
                    keep_last=keep_last,
                    protect=protect,
                )
            )
        )
    path = _shared(outcome)
    return path if rank == 0 else None


def lock_save_dir(save_dir: str, config: MambaConfig) -> Optional[SaveDirLock]:
    """Global rank 0 takes the save directory's lock for the job's life, removes dead jobs' staging folders
    and checks there is room for a checkpoint of `config` (collective); the lock on rank 0.

    CheckpointError on every rank, naming the holder, when another job holds it, or with the numbers when
    the directory is short of room. Call before anything reads or writes the directory; release it (rank
    0) when the job ends.
    """
    lock = SaveDirLock(save_dir, JOB_TOKEN) if dist.get_rank() == 0 else None
    world = dist.get_world_size()
    previous = _shared(_outcome(lambda: open_save_dir(lock, checkpoint_size(config, world), world)) if lock else None)
    if previous and dist.get_rank() == 0:
        log.info(f"note: took over the lock of {save_dir} from a job that did not release it: {describe(previous)}")
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
            answer = (
                ("ok", ("none", (logging.INFO, f"--load auto: nothing to resume ({e})")))
                if load == "auto"
                else ("error", str(e))
            )
        except CheckpointError as e:
            answer = ("error", str(e))
            if save_dir and os.path.realpath(load) == os.path.realpath(save_dir) and not checkpoint_tags(save_dir):
                answer = (
                    "ok",
                    ("none", (logging.WARNING, f"--load {load} is the --save directory and holds no checkpoint yet")),
                )
    kind, value = _shared(answer)
    if kind == "none":
        if dist.get_rank() == 0:
            level, text = value
            log.log(level, f"{text}; starting from step 0")
        return None
    checkpoint = Checkpoint(value, hashes=False)
    checkpoint.check_config(config)
    return checkpoint


def load(trainer, checkpoint: Checkpoint, config: MambaConfig, load_optim: bool = True, load_rng: bool = True) -> int:
    """Restore parameters, masters, optimizer state, scheduler and RNG of this rank; returns the step.

    Each parameter reads only the stored pieces its own cut overlaps. load_optim False (Megatron's
    --no-load-optim): the weights only; optimizer state and LR schedule stay fresh (moments zero,
    scheduler at its step 0). load_rng False (--no-load-rng): the RNG states stay as they are. The
    step count continues either way.
    """
    parameters = trainer.named_parameters()
    cuts = {n: (name, _cut(p, trainer.tp)[1]) for n, name, p in parameters}
    values = checkpoint.model_cuts(cuts)
    check_finite_on_every_rank(values, cuts, checkpoint.path)
    with torch.no_grad():
        for n, _, p in parameters:
            if values[n].shape != p.shape:
                raise CheckpointError(
                    f"{checkpoint.path}: {cuts[n][0]} gives shape {tuple(values[n].shape)} for "
                    f"parameter {n} of shape {tuple(p.shape)}"
                )
            p.copy_(values[n])
    optimizer, saved_groups = {}, None
    if load_optim:
        optimizer = checkpoint.optimizer_cuts(cuts)
        mine = {name for name, _ in cuts.values()}
        saved_groups = [{**g, "params": [m for m in g["params"] if m in mine]} for g in checkpoint.optimizer_groups]
    zero = _zero(trainer)
    if zero is not None:
        _load_zero(trainer, zero, values, optimizer, saved_groups)
    elif load_optim:
        trainer.restore_optimizer_state(optimizer, saved_groups)
    if load_optim:
        trainer.restore_scheduler(checkpoint.scheduler, checkpoint.step)
    if load_rng:
        restore_rng(checkpoint.rng_state(dist.get_rank(), dist.get_world_size()))
    trainer.set_global_step(checkpoint.step)
    return checkpoint.step


def _load_zero(trainer, zero, masters: dict, optimizer: dict, saved_groups: Optional[list]) -> None:
    """ZeRO: fresh flat Adam state at the saved step, linked, then each parameter's fp32 master and moments set
    from this rank's cuts (`masters`, `optimizer`: by module parameter name).

    saved_groups None: no optimizer state is loaded (`optimizer` empty), only the masters are set.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if saved_groups is not None:
        check_optimizer_groups(saved_groups, trainer.optimizer_groups())
    steps = {t.item() for state in optimizer.values() for key, t in state.items() if key == "step"}
    if len(steps) > 1:
        raise CheckpointError(f"checkpoint optimizer holds different step counts {sorted(steps)}; ZeRO keeps one")
    if steps:
        missing = sorted(
            n
            for n, _, p in trainer.named_parameters()
            if p.requires_grad and any(m not in optimizer.get(n, {}) for m in MOMENTS)
        )
        if missing:
            raise CheckpointError(f"checkpoint optimizer state has no Adam moments for {missing[:5]}")
        for flat in zero_flat_masters(zero):
            group = next(g for g in zero.optimizer.param_groups if any(p is flat for p in g["params"]))
            zero.optimizer.state[flat] = {
                "step": adam_step(next(iter(steps)), flat, group),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        link_zero_moments(zero)
    with torch.no_grad():
        for name, _, p in trainer.named_parameters():
            if not p.requires_grad:  # no master: `load` has set it
                continue
            safe_set_full_fp32_param(p, masters[name].float())
            for moment in MOMENTS if steps else ():
                safe_set_full_optimizer_state(p, optimizer[name][moment], moment)


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


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's checkpoint, resume and --init-from flags (docs/flags.md)."""
    p = parser.add_argument_group("checkpoints")
    p.add_argument("--save", default=None, help="checkpoint directory (created and checked writable at start-up)")
    p.add_argument(
        "--load",
        default=None,
        help="resume from: auto (the newest complete checkpoint under --save; none yet: start afresh), "
        "a save directory (its latest) or a checkpoint directory",
    )
    p.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --load: the weights and the step count only; fresh optimizer state and LR schedule",
    )
    p.add_argument("--no-load-rng", action="store_true", help="with --load: do not restore the RNG states")
    p.add_argument(
        "--override-data-check",
        action="store_true",
        help="resume even though the data, tokenizer, --seq-length, --seed or document resets differ from "
        "the checkpoint's (refused otherwise): the sample stream continues at its count with the new "
        "settings",
    )
    p.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="resume even though the LR plan differs from the checkpoint's (refused otherwise): follow "
        "the flags' plan from the checkpoint's step",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of DIR (a checkpoint or save directory, a model folder, a mamba_ssm "
        "or transformers Mamba/Mamba2 folder; checksums verified when it has a manifest) at step 0 "
        "with a fresh optimizer, LR schedule and RNG; its config must equal --model-config. A "
        "checkpoint that --load finds wins: --init-from DIR --save D --load auto resumes on requeue",
    )
    p.add_argument(
        "--finetune",
        action="store_true",
        help="Megatron's: only the weights of --load, at step 0 with a fresh optimizer, LR schedule and "
        "RNG (the same as --init-from, which a requeue-safe job uses with --load auto)",
    )
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every this many steps (0: at the end)")
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints to keep (default: all)")
