"""One checkpoint: what it holds, `save_checkpoint` to write it, `Checkpoint` to read it.

    <save>/step_000123/
        config.json            the model config (mamba_ssm form)
        model.safetensors      parameters: mamba_ssm names, full shapes, the padded vocab of the
                               config (no TP padding); a tied head is left out
        optimizer.safetensors  per-parameter optimizer state, "<name>/<key>" (state.py)
        rng.safetensors        every rank's RNG states (rng.py)
        trainer_state.json     {"format_version", "step", "optimizer": {"param_groups"},
                               "scheduler", "extra": whatever the trainer adds (args, layout, data position)}
        tokenizer files        when a tokenizer is given (tokenizer.json / tokenizer.model / tokenizer_config.json)
        manifest.json          written last: sizes and sha256 of all the above (manifest.py)

Nothing depends on the (dp, tp, pp) layout that wrote it, so any layout reads it; config.json +
model.safetensors (+ tokenizer) also make it a model folder (`megamamba.model_folder`).
Everything is read without unpickling: safetensors and JSON only.

`save_checkpoint` runs in ONE process, given full tensors (the trainer gathers them; see the
package docstring). It stages, fsyncs and commits through `store`, so a crash leaves the
previous checkpoint and `latest` intact.
"""
import dataclasses
import functools
import json
import os
from typing import Iterable, Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open

from megamamba import model_folder
from megamamba.checkpoint import files
from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.files import CheckpointError, read_json
from megamamba.checkpoint.manifest import verify
from megamamba.checkpoint.state import EMBEDDING, HEAD
from megamamba.checkpoint.store import check_keep_last, commit, resolve_load, stage, tag_for
from megamamba.config import ConfigError, MambaConfig
from megamamba.lm import MambaLM

CONFIG_FILE, MODEL_FILE = model_folder.CONFIG_FILE, model_folder.WEIGHTS_FILE
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1


def parameter_shapes(config: MambaConfig) -> dict:
    """name -> full shape of every parameter the config implies (tied head left out)."""
    return dict(_parameter_shapes(json.dumps(config.to_dict(), sort_keys=True)))


@functools.lru_cache(maxsize=8)
def _parameter_shapes(config_json: str) -> tuple:
    with torch.device("meta"):  # no memory, but initialisation on meta tensors still costs ~0.1 s
        model = MambaLM(MambaConfig.from_dict(json.loads(config_json)))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def check_model_tensors(model: Mapping[str, torch.Tensor], config: MambaConfig, source: str) -> dict:
    """The model tensors without a (tied, equal) head; CheckpointError when names or shapes do not fit the config."""
    tensors = dict(model)
    if config.tie_embeddings and HEAD in tensors:
        if EMBEDDING in tensors and not torch.equal(tensors[HEAD].cpu(), tensors[EMBEDDING].cpu()):
            raise CheckpointError(f"{source}: tie_embeddings is true but {HEAD} differs from {EMBEDDING}")
        del tensors[HEAD]
    shapes = parameter_shapes(config)
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(f"{source}: tensors do not match the model config: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(f"{source}: {name} has shape {tuple(t.shape)}, the model config implies "
                                  f"{shapes[name]} (full shapes, without tensor-parallel vocab padding)")
    return tensors


def save_checkpoint(save_dir: str, step: int, config: MambaConfig, model: Mapping[str, torch.Tensor], *,
                    optimizer: Optional[Mapping[str, torch.Tensor]] = None, optimizer_groups: Optional[list] = None,
                    scheduler: Optional[dict] = None, rng: Optional[list] = None, extra: Optional[dict] = None,
                    tokenizer=None, keep_last: Optional[int] = None) -> str:
    """Write the checkpoint of `step` under `save_dir` atomically; returns its path.

    model: full tensors by mamba_ssm name (`state.model_tensors`). optimizer / optimizer_groups:
    `state.optimizer_tensors` / `state.optimizer_groups`. scheduler: `state.scheduler_state`.
    rng: every rank's `rng.capture_rng()` in global rank order (default: this process's).
    extra: JSON the trainer wants back (args, layout, data position). tokenizer: anything with
    `save(directory)`. keep_last: how many checkpoints to keep (None: all).
    """
    check_keep_last(keep_last)
    model = check_model_tensors(model, config, "save_checkpoint")
    state = {"format_version": FORMAT_VERSION, "step": step,
             "optimizer": {"param_groups": optimizer_groups or []}, "scheduler": scheduler, "extra": extra or {}}
    try:
        state = json.loads(json.dumps(state))
    except TypeError as e:
        raise CheckpointError(f"save_checkpoint: trainer state is not JSON ({e})") from None
    tag = tag_for(step)
    os.makedirs(save_dir, exist_ok=True)
    staging = stage(save_dir, tag)
    files.write_json(os.path.join(staging, CONFIG_FILE), config.to_dict())
    files.write_tensors(os.path.join(staging, MODEL_FILE), model, metadata={"format": "pt"})
    files.write_tensors(os.path.join(staging, OPTIMIZER_FILE), dict(optimizer or {}))
    rng_tensors, rng_metadata = rng_files.to_file(rng if rng is not None else [rng_files.capture_rng()])
    files.write_tensors(os.path.join(staging, RNG_FILE), rng_tensors, metadata=rng_metadata)
    files.write_json(os.path.join(staging, STATE_FILE), state)
    if tokenizer is not None:
        tokenizer.save(staging)
    return commit(save_dir, staging, tag, step, keep_last)


def config_differences(saved: MambaConfig, run: MambaConfig) -> list:
    """"field: checkpoint X, run Y" for every field that differs (mixer options with defaults filled in)."""
    def flat(config: MambaConfig) -> dict:
        fields = {k: v for k, v in config.to_dict().items() if k != "ssm_cfg"}
        fields["ssm_cfg.layer"] = config.layer
        options = json.loads(json.dumps(dataclasses.asdict(config.mixer_options)))
        fields.update({f"ssm_cfg.{k}": v for k, v in options.items()})
        return fields

    a, b = flat(saved), flat(run)
    return [f"{k}: checkpoint {a.get(k)!r}, run {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class Checkpoint:
    """A complete checkpoint, verified when opened (sizes, and sha256 unless hashes=False)."""

    def __init__(self, path: str, hashes: bool = True):
        self.path = path
        self.manifest = verify(path, hashes)
        self.tag = self.manifest["tag"]
        self.step = self.manifest["step"]
        self.state = read_json(os.path.join(path, STATE_FILE), "trainer state")
        if self.state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{os.path.join(path, STATE_FILE)}: format version "
                                  f"{self.state.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        config_path = os.path.join(path, CONFIG_FILE)
        try:
            self.config = MambaConfig.from_dict(read_json(config_path, "model config"))
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"{config_path}: {e}") from None

    @property
    def extra(self) -> dict:
        return self.state["extra"]

    def check_config(self, run: MambaConfig) -> None:
        """CheckpointError naming every field where the run's model config differs from the checkpoint's."""
        diff = config_differences(self.config, run)
        if diff:
            raise CheckpointError(f"{self.path}: the model config differs from the run's: {'; '.join(diff)}. "
                                  "Resume with the checkpoint's config.json, or start a new run (--load unset)")

    def _read(self, file: str, names: Optional[Iterable[str]]) -> dict:
        path = os.path.join(self.path, file)
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                wanted = keys if names is None else set(names)
                absent = sorted(wanted - keys)
                if absent:
                    raise CheckpointError(f"{path}: has no tensors {absent[:5]}")
                return {k: f.get_tensor(k) for k in sorted(wanted)}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None

    def model_tensors(self, names: Optional[Iterable[str]] = None) -> dict:
        """Full parameters by mamba_ssm name (all, or `names`: e.g. one pipeline stage's), on the CPU.

        With tie_embeddings, asking for lm_head.weight gives the embedding.
        """
        names = None if names is None else list(names)
        tied = self.config.tie_embeddings and names is not None and HEAD in names
        wanted = None if names is None else [EMBEDDING if tied and n == HEAD else n for n in names]
        tensors = self._read(MODEL_FILE, None if wanted is None else set(wanted))
        if names is None:
            return check_model_tensors(tensors, self.config, os.path.join(self.path, MODEL_FILE))
        return {n: tensors[EMBEDDING if tied and n == HEAD else n] for n in names}

    def optimizer_tensors(self, names: Optional[Iterable[str]] = None) -> dict:
        """Optimizer state "<name>/<key>" of all parameters, or of the parameters in `names`."""
        if names is None:
            return self._read(OPTIMIZER_FILE, None)
        wanted = set(names)
        with safe_open(os.path.join(self.path, OPTIMIZER_FILE), framework="pt") as f:
            keys = [k for k in f.keys() if k.rpartition("/")[0] in wanted]
        return self._read(OPTIMIZER_FILE, keys)

    @property
    def optimizer_groups(self) -> list:
        return self.state["optimizer"]["param_groups"]

    @property
    def scheduler(self) -> Optional[dict]:
        return self.state["scheduler"]

    def rng_states(self) -> list:
        path = os.path.join(self.path, RNG_FILE)
        with safe_open(path, framework="pt") as f:
            return rng_files.from_file({k: f.get_tensor(k) for k in f.keys()}, f.metadata())


def open_checkpoint(load: str, save_dir: Optional[str] = None, hashes: bool = True) -> Checkpoint:
    """The checkpoint a `--load` value names ("auto", a checkpoint directory, or a save directory)."""
    return Checkpoint(resolve_load(load, save_dir, hashes), hashes=False)

