"""Training that starts from existing weights: `--init-from DIR`, and Megatron's `--finetune`.

DIR is one of our checkpoints (a step folder, or a save directory: its `latest`), a model folder
(ours, or mamba_ssm's converted or original), or a transformers Mamba / Mamba2 export
(`megamamba.checkpoint.model_folder.FolderWeights` reads them all). Global rank 0 resolves DIR and verifies a
checkpoint's manifest (sizes and sha256 of every file); a folder without a manifest is read
unverified, and the start-up line says so. The folder's model config must equal the run's (a
transformers folder that stores only the padded vocabulary, as others' and our older exports do:
its vocab_size counts as the run's when the padded sizes agree). Every rank reads only its
pipeline stage's tensors and cuts its TP slice out of them (the extra vocab rows a TP size needs
are zeros, as when resuming); under ZeRO the float32 masters are set too (under ZeRO-3 from this
rank's parameter partitions). The trainer keeps its fresh optimizer, LR schedule and RNG, and
starts at step 0.

One mechanism, two spellings: `--finetune --load X` (Megatron: --load's weights only) is
`--init-from X`. With `--init-from X` and `--load`, a checkpoint that --load finds wins, so a
requeued fine-tuning job (`--init-from X --save D --load auto`) resumes its own progress.
"""

import dataclasses
import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megamamba.checkpoint import CheckpointError, config_differences, resolve_model_folder
from megamamba.checkpoint.checkpoint import check_model_shapes
from megamamba.checkpoint.finite import DamagedWeightsError
from megamamba.checkpoint.manifest import verify
from megamamba.checkpoint.model_folder import FolderWeights, ModelFolderError
from megamamba.config import MambaConfig
from megamamba.parallel import full_key
from megamamba.parallel.local_part import local_part
from megamamba.pipelines.deepspeed_internals import full_shape, zero3_masters, zero3_partition
from megamamba.pipelines.job.finite_weights import raise_first_rank_error


class InitSource(NamedTuple):
    flag: str  # how the run named it: "--init-from DIR" or "--finetune --load DIR"
    folder: str  # the folder read (a save directory resolves to its checkpoint)
    note: str  # what it is and how it was verified
    weights: FolderWeights


def check_flags(init_from: Optional[str], finetune: bool, load: Optional[str]) -> None:
    """Start-up checks (no process group): ValueError with one message."""
    if finetune and not load:
        raise ValueError("--finetune takes the weights of --load, but --load is not set")
    if finetune and init_from:
        raise ValueError(
            f"--finetune (the weights of --load {load}) and --init-from {init_from} both name the "
            "initial weights; keep --init-from (with --load auto --save D a requeue resumes)"
        )
    if finetune and load == "auto":
        raise ValueError(
            "--finetune --load auto: would restart the newest checkpoint of --save at step 0 on every "
            "requeue; use --init-from DIR --load auto --save D"
        )
    if init_from and not os.path.isdir(init_from):
        raise ValueError(f"--init-from {init_from}: no such directory")


def sources(init_from: Optional[str], finetune: bool, load: Optional[str]) -> tuple:
    """(the --load to resume from, the flag and folder to initialize from when nothing is resumed)."""
    if finetune:
        return None, (f"--finetune --load {load}", load)
    return load, (f"--init-from {init_from}", init_from) if init_from else None


def describe_source(path: str, flag: str) -> tuple:
    """(folder, note) of `path` (global rank 0): a checkpoint verified in full, a plain folder as it is."""
    folder, verified = resolve_model_folder(path, flag=flag)
    if not verified:
        return folder, "not verified: no manifest.json"
    manifest = verify(folder, hashes=False)  # verified in full above; this reads the manifest
    files = len(manifest["files"])
    return folder, f"checkpoint of step {manifest['step']}, verified: sizes and sha256 of {files} files"


def check_config(weights: FolderWeights, run: MambaConfig, flag: str) -> None:
    """CheckpointError naming every field where the folder's model config differs from the run's."""
    folder = weights.config
    if weights.hf and folder.vocab_size == run.padded_vocab_size:
        folder = dataclasses.replace(
            folder, vocab_size=run.vocab_size, pad_vocab_size_multiple=run.pad_vocab_size_multiple
        )
    diff = [d.replace(": checkpoint ", ": folder ", 1) for d in config_differences(folder, run)]
    if diff:
        raise CheckpointError(
            f"{flag}: the model config of {weights.directory} differs from --model-config: {'; '.join(diff)}"
        )


def open_source(flag: str, path: str, run: MambaConfig) -> InitSource:
    """The folder to initialize from, verified and checked against the run's config (collective)."""
    answer = None
    if dist.get_rank() == 0:
        try:
            answer = ("ok", describe_source(path, flag))
        except (CheckpointError, OSError) as e:
            answer = ("error", str(e))
    box = [answer]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    folder, note = value
    try:
        weights = FolderWeights(folder)
        check_config(weights, run, flag)
        check_model_shapes(weights.shapes(), run, folder)
    except ModelFolderError as e:
        raise CheckpointError(f"{flag}: {e}") from None
    if note.startswith("not verified"):
        note = f"{weights.kind}, {note}"
    return InitSource(flag, folder, note, weights)


@torch.no_grad()
def _set_zero3_partition(param, value: torch.Tensor) -> None:
    """This rank's ZeRO-3 partition of `param` (zero padding past the end) cut from its full value."""
    part, start, end = zero3_partition(param)
    piece = value.reshape(-1)[start:end]
    part.data.zero_()
    part.data[: piece.numel()].copy_(piece)


@torch.no_grad()
def _copy_zero3_masters(optimizer, flag: str) -> None:
    """ZeRO-3's float32 master partitions set from the parameter partitions, as DeepSpeed builds them."""
    for master, partition in zero3_masters(optimizer):
        if partition is None or master.numel() != partition.numel():
            raise CheckpointError(f"{flag}: ZeRO-3 with parameters or optimizer state swapped to NVMe is not supported")
        master.copy_(partition)


def load_weights(trainer, source: InitSource) -> None:
    """Set every parameter of this rank (and its optimizer master) from the folder, reading one full tensor at a
    time (checked finite) and keeping only this rank's slice of it; collective."""
    # a TP parameter may come in parts under one full name (`in_proj.weight` and `in_proj.weight_replicated`)
    by_name: dict = {}
    for n, name, p in trainer.named_parameters():
        by_name.setdefault(name, []).append((full_key(n, p), p))
    zero_stage = trainer.zero_stage()
    error = None
    try:
        for name, full in source.weights.each(sorted(by_name)):
            for key, param in by_name[name]:
                _set_parameter(trainer, param, _slice(trainer, full, param, name, key, source.flag), zero_stage)
    except DamagedWeightsError as e:
        error = str(e)
    except ModelFolderError as e:
        error = f"{source.flag}: rank {dist.get_rank()}: {e}"
    except CheckpointError as e:
        error = str(e)
    raise_first_rank_error(error)
    if zero_stage == 3:
        _copy_zero3_masters(trainer.engine_optimizer(), source.flag)


def _slice(trainer, full: torch.Tensor, param, name: str, key: str, flag: str) -> torch.Tensor:
    """This rank's part of the full tensor `name` for the parameter `key`, its shape checked."""
    value = local_part(full, param, trainer.tp)
    shape = tuple(full_shape(param))
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{flag}: {name} gives shape {tuple(value.shape)} for parameter {key} of shape {shape}")
    return value


@torch.no_grad()
def _set_parameter(trainer, param, value: torch.Tensor, zero_stage: int) -> None:
    """A parameter (its ZeRO-3 partition, or its ZeRO-1/2 fp32 master too) set from this rank's part of its tensor."""
    from deepspeed.utils import safe_set_full_fp32_param

    if zero_stage == 3:
        _set_zero3_partition(param, value)
        return
    param.copy_(value)
    if zero_stage:
        safe_set_full_fp32_param(param, value.float())


def startup_line(source: InitSource) -> str:
    """The line a run initialised from `source` logs (global rank 0)."""
    return f"initialized from {source.folder} ({source.note}): step 0, fresh optimizer"
