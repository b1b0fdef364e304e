"""Weights and checkpoints on disk: layout-free checkpoints that a crash cannot corrupt, model
folders, safetensors streams and the Hugging Face format (no DeepSpeed here).

Checkpoints hold mamba_ssm names and full shapes in safetensors and JSON, written by every rank
that holds a distinct shard and readable at any layout, committed atomically with a verified
manifest. This package re-exports the checkpoint API its modules define. Format, commit protocol and the distributed
save/load steps: docs/checkpoints.md ("The format and its code").
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
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "NoCheckpointError",
    "adam_step",
    "begin",
    "capture_rng",
    "check_optimizer_groups",
    "check_save_dir",
    "config_differences",
    "find_latest",
    "finish",
    "load_model_tensors",
    "load_optimizer_tensors",
    "load_scheduler_state",
    "load_training_checkpoint",
    "model_tensors",
    "open_checkpoint",
    "optimizer_groups",
    "optimizer_tensors",
    "parameter_shapes",
    "resolve_load",
    "resolve_model_folder",
    "restore_optimizer_state",
    "restore_rng",
    "save_checkpoint",
    "save_training_checkpoint",
    "scheduler_state",
    "tag_for",
    "whole",
    "write_rng",
    "write_shard",
]
