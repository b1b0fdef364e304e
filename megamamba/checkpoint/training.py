"""Save and resume a plain PyTorch training run (a `MambaLM`, a torch optimizer, an LR scheduler).

This is the whole protocol in one process, and the reference the distributed trainer follows:
the same contents, written by the ranks in the pieces each holds instead of from one model (package docstring).
A resume restores parameters, optimizer state, scheduler and RNG bit for bit, so training on
continues exactly as an uninterrupted run would.
"""

from typing import Optional

import torch

from megamamba.checkpoint.checkpoint import Checkpoint
from megamamba.checkpoint.rng import capture_rng, restore_rng
from megamamba.checkpoint.state import (
    load_model_tensors,
    load_optimizer_tensors,
    load_scheduler_state,
    model_tensors,
    optimizer_groups,
    optimizer_tensors,
    scheduler_state,
)
from megamamba.checkpoint.writer import save_checkpoint
from megamamba.model.lm import MambaLM


def save_training_checkpoint(
    save_dir: str,
    step: int,
    model: MambaLM,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    extra: Optional[dict] = None,
    tokenizer=None,
    keep_last: Optional[int] = None,
) -> str:
    """Checkpoint after `step` optimizer steps of a single-process run; returns its path."""
    return save_checkpoint(
        save_dir,
        step,
        model.config,
        model_tensors(model),
        optimizer=optimizer_tensors(optimizer, model),
        optimizer_groups=optimizer_groups(optimizer, model),
        scheduler=None if scheduler is None else scheduler_state(scheduler),
        rng=[capture_rng()],
        extra=extra,
        tokenizer=tokenizer,
        keep_last=keep_last,
    )


def load_training_checkpoint(
    checkpoint: Checkpoint,
    model: MambaLM,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    load_optim: bool = True,
    load_rng: bool = True,
) -> int:
    """Restore a single-process run from `checkpoint` (its model config must equal the model's); returns the step.

    load_optim False (Megatron's --no-load-optim): the weights only, optimizer and scheduler stay fresh;
    load_rng False (--no-load-rng): the RNG states stay as they are.
    """
    checkpoint.check_config(model.config)
    load_model_tensors(model, checkpoint.model_tensors(), source=checkpoint.path)
    if load_optim:
        load_optimizer_tensors(optimizer, model, checkpoint.optimizer_tensors(), checkpoint.optimizer_groups)
        if scheduler is not None:
            load_scheduler_state(scheduler, checkpoint.scheduler, checkpoint.step)
    if load_rng:
        restore_rng(checkpoint.rng_state(0, 1))
    return checkpoint.step
