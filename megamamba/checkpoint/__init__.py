"""Layout-free checkpoints that a crash cannot corrupt.

Format (checkpoint.py): mamba_ssm parameter names and full shapes, per-parameter optimizer state
under the same names, scheduler and RNG states, the model config and whatever JSON the trainer
adds, in safetensors and JSON files, with a manifest written last. Several ranks write the
tensors, each the pieces it holds (megamamba.tensor_pieces: its TP rows, its ZeRO fragment), and
any layout reads them back (megamamba.folder_tensors). Writing (writer.py): each process writes
its own files, one commits. Storage (store.py): staged in a temporary directory named by the job,
fsynced, renamed into place, `latest` switched atomically, old ones pruned (never a protected
one, never another live job's staging). One job writes a save directory at a time: lock.py's
SaveDirLock, held for the job's life. Every load path verifies the manifest's sizes and checksums
first.

Single process (tests, the plain trainer):

    check_save_dir(save_dir)                                        # at start-up
    save_training_checkpoint(save_dir, step, model, optimizer, scheduler, extra=..., keep_last=3)
    step = load_training_checkpoint(open_checkpoint("auto", save_dir), model, optimizer, scheduler)

Distributed trainer (any dp x cp x tp x pp; megamamba.pipelines.checkpointing is the implementation).
Tensors move only through files; object collectives carry a few hundred bytes per rank (a path,
file sizes and hashes, an error message).

    save:  1. global rank 0: staging = begin(save_dir, step, keep_last); broadcast the path;
           2. every rank: write_shard(staging, rank, params, optimizer, groups) with the `Held`
              pieces only it holds under mamba_ssm names (pipelines.names.to_mamba): without ZeRO
              the first data rank its TP rows (Piece(name, full shape, Cut(dim, rows, local shape)))
              of each parameter and AdamW state; under ZeRO every data rank its fragment of the fp32
              masters and moments (param._hp_mapping: the flat range lp_fragment_address of the local
              parameter, get_hp_fragment(key); DeepSpeed 0.19.8 links moments to parameters only for
              groups stepped before its first link: call deepspeed.utils.
              lazy_init_hp_params_optimizer_state per group first); a replicated tensor from TP
              rank 0 only; the stage's representative adds the 0-d states and optimizer_groups(...);
              write_rng(staging, rank, capture_rng()); gather the returned records to rank 0;
           3. rank 0: finish(save_dir, staging, step, config, records, scheduler=scheduler_state(...),
              extra={args, layout, data position}, ...), which checks every element is stored once,
              then broadcast the outcome (the others must not exit or save again before it is
              committed, and fail with rank 0 when it fails).
    load:  rank 0: path = resolve_load(load, save_dir) (verifies hashes), broadcast path; every rank:
           ckpt = Checkpoint(path, hashes=False); ckpt.check_config(run_config);
           ckpt.model_cuts({key: (mamba name, its Cut)}) -> each parameter's local tensor, reading only
           the pieces it overlaps (under ZeRO also safe_set_full_fp32_param); ckpt.optimizer_cuts(same)
           -> restore_optimizer_state, or for ZeRO: create the flat AdamW state (adam_step for `step`),
           link, safe_set_full_optimizer_state; load_scheduler_state; restore_rng(ckpt.rng_state(rank, world)).

Memory: a writer holds nothing beyond its own state but one host copy of one tensor while writing
(files are written tensor by tensor); global rank 0 reads only the files' headers.
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
    restore_optimizer_state,
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
from megamamba.checkpoint.writer import begin, finish, save_checkpoint, whole, write_rng, write_shard

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointWarning", "NoCheckpointError", "adam_step", "begin", "capture_rng",
    "check_optimizer_groups", "check_save_dir", "config_differences", "find_latest", "finish", "load_model_tensors",
    "load_optimizer_tensors", "load_scheduler_state", "load_training_checkpoint", "model_tensors", "open_checkpoint",
    "optimizer_groups", "optimizer_tensors", "parameter_shapes", "resolve_load", "resolve_model_folder",
    "restore_optimizer_state", "restore_rng", "save_checkpoint", "save_training_checkpoint", "scheduler_state",
    "tag_for", "whole", "write_rng", "write_shard",
]
