"""Layout-free checkpoints that a crash cannot corrupt.

Format (checkpoint.py): mamba_ssm parameter names and full shapes, per-parameter optimizer state
under the same names, scheduler and RNG states, the model config and whatever JSON the trainer
adds, in safetensors and JSON files, with a manifest written last. Writing (writer.py): each
process writes its own files (a pipeline stage its shards, a rank its RNG state), one commits.
Storage (store.py): staged in a temporary directory named by the job, fsynced, renamed into
place, `latest` switched atomically, old ones pruned (never a protected one, never another live
job's staging). One job writes a save directory at a time: lock.py's SaveDirLock, held for the
job's life. Every load path verifies the manifest's sizes and checksums first.

Single process (tests, the plain trainer):

    check_save_dir(save_dir)                                        # at start-up
    save_training_checkpoint(save_dir, step, model, optimizer, scheduler, extra=..., keep_last=3)
    step = load_training_checkpoint(open_checkpoint("auto", save_dir), model, optimizer, scheduler)

Distributed trainer (any dp x tp x pp; megamamba.pipelines.checkpointing is the implementation,
tests/checkpoint/test_checkpoint_deepspeed.py the executable recipe for DeepSpeed's ZeRO-1).
Tensors move only through tensor collectives and files; object collectives carry a few hundred
bytes per rank (a path, file sizes and hashes, an error message).

    save:  1. per stage, collectively over TP (and DP inside the safe_get_* calls):
              params = full_tensors(module, tp, select=safe_get_full_fp32_param) (the fp32 master;
              model_tensors(module, tp) when the optimizer keeps none), the moments likewise with
              select=lambda p: safe_get_full_optimizer_state(p, "exp_avg") / "exp_avg_sq" as
              "<name>/<key>", and "<name>/step" from the inner optimizer's state; a plain torch
              optimizer: optimizer_tensors(optimizer, module, tp). DeepSpeed 0.19.8 links moments
              to parameters only for groups stepped before its first link: call
              deepspeed.utils.lazy_init_hp_params_optimizer_state per group first. Pipeline names
              -> mamba_ssm names: pipelines.names.to_mamba;
           2. global rank 0: staging = begin(save_dir, step, keep_last); broadcast the path;
           3. each stage's representative (dp 0, tp 0): write_stage(staging, stage, stages, params,
              optimizer, optimizer_groups(...)); every rank: write_rng(staging, rank, capture_rng());
              gather the returned records (file -> size, sha256) to rank 0;
           4. rank 0: finish(save_dir, staging, step, config, records, scheduler=scheduler_state(...),
              extra={args, layout, data position}, ...), then broadcast the outcome (the others must
              not exit or save again before it is committed, and fail with rank 0 when it fails).
    load:  rank 0: path = resolve_load(load, save_dir) (verifies hashes), broadcast path; every rank:
           ckpt = Checkpoint(path, hashes=False); ckpt.check_config(run_config);
           ckpt.model_tensors(names of this stage) -> load_model_tensors / load_full_tensors (TP slices)
           (and safe_set_full_fp32_param); ckpt.optimizer_tensors(names) -> load_optimizer_tensors,
           or for ZeRO: create the flat AdamW state (adam_step for `step`), link,
           safe_set_full_optimizer_state; load_scheduler_state; restore_rng(ckpt.rng_state(rank, world)).

Memory: a stage's representative holds its stage's full parameters and optimizer moments on the
CPU while saving (about 12 bytes per parameter in float32); global rank 0 holds no more than that.
"""
from megamamba.checkpoint.checkpoint import Checkpoint, config_differences, open_checkpoint, parameter_shapes
from megamamba.checkpoint.files import CheckpointError
from megamamba.checkpoint.rng import capture_rng, restore_rng
from megamamba.checkpoint.state import (
    adam_step,
    check_optimizer_groups,
    load_model_tensors,
    load_optimizer_tensors,
    load_scheduler_state,
    model_tensors,
    optimizer_groups,
    optimizer_tensors,
    scheduler_state,
)
from megamamba.checkpoint.store import (
    CheckpointWarning,
    NoCheckpointError,
    check_save_dir,
    find_latest,
    resolve_load,
    resolve_model_folder,
    tag_for,
)
from megamamba.checkpoint.training import load_training_checkpoint, save_training_checkpoint
from megamamba.checkpoint.writer import begin, finish, save_checkpoint, write_rng, write_stage

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointWarning", "NoCheckpointError", "adam_step", "begin", "capture_rng",
    "check_optimizer_groups", "check_save_dir", "config_differences", "find_latest", "finish", "load_model_tensors",
    "load_optimizer_tensors", "load_scheduler_state", "load_training_checkpoint", "model_tensors", "open_checkpoint",
    "optimizer_groups", "optimizer_tensors", "parameter_shapes", "resolve_load", "resolve_model_folder", "restore_rng",
    "save_checkpoint", "save_training_checkpoint", "scheduler_state", "tag_for", "write_rng", "write_stage",
]
