"""A model folder: `config.json` + the weights (+ the tokenizer's files), read without unpickling.

`FolderWeights` reads any folder whose weights training may start from, one stage's tensors at a
time: ours (a model folder or a checkpoint), mamba_ssm's and transformers' Mamba / Mamba2 / NemotronH exports.
The folder's format: docs/checkpoints.md.
"""

import json
import os
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megamamba.checkpoint.finite import check_finite
from megamamba.checkpoint.folder_tensors import FolderTensors, ModelFolderError, index_file, read_folder_tensors
from megamamba.checkpoint.hf import HFFormatError, Part, decode_special_floats
from megamamba.checkpoint.transformers_formats import (
    architecture,
    assemble,
    file_names,
    file_parts,
    held_shape,
    import_config,
    our_shape,
    zero_tensors,
)
from megamamba.config import ConfigError, MambaConfig
from megamamba.model.layer_types.head import tie
from megamamba.model.layers import EMBEDDING, HEAD
from megamamba.model.lm import MambaLM

CONFIG_FILE = "config.json"
WEIGHTS_STEM = "model"
WEIGHTS_FILE = f"{WEIGHTS_STEM}.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"


def save_model_folder(model: MambaLM, directory: str, tokenizer=None) -> None:
    """Write config.json, model.safetensors (head left out when tied) and the tokenizer's files."""
    os.makedirs(directory, exist_ok=True)
    model.config.to_json(os.path.join(directory, CONFIG_FILE))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state[HEAD]
    save_file(state, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)


def read_weights(path: str) -> dict:
    """Every tensor of a safetensors file, on the CPU, never unpickling; ModelFolderError when unreadable."""
    if not os.path.isfile(path):
        raise ModelFolderError(f"{path}: no such file")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as e:
        raise ModelFolderError(f"{path}: not a readable safetensors file ({e})") from None


def _check_keys(path: str, state: dict, model: MambaLM) -> None:
    expected = model.state_dict()
    if model.config.tie_embeddings and HEAD in state:
        if EMBEDDING in state and not torch.equal(state[HEAD], state[EMBEDDING]):
            raise ModelFolderError(f"{path}: tie_embeddings is true but {HEAD} differs from {EMBEDDING}")
        state.pop(HEAD)
    missing = sorted(set(expected) - set(state) - ({HEAD} if model.config.tie_embeddings else set()))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelFolderError(f"{path}: tensors do not match the config: missing {missing}, unexpected {unexpected}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ModelFolderError(
                f"{path}: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[key].shape)}"
            )


def load_model_folder(directory: str, device=None, dtype: Optional[torch.dtype] = None) -> MambaLM:
    """The model of a folder, in eval mode, on `device`, in `dtype` (None keeps the stored dtypes); its stored
    tensors checked finite."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelFolderError(f"{config_path}: no such file (a model folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = MambaConfig.from_json(config_path)
    sharded = os.path.isfile(os.path.join(directory, index_file(WEIGHTS_STEM)))
    weights_path = os.path.join(directory, index_file(WEIGHTS_STEM) if sharded else WEIGHTS_FILE)
    state = read_folder_tensors(directory, WEIGHTS_STEM)
    check_finite(state, weights_path)
    with torch.device("meta"):
        model = MambaLM(config)
    _check_keys(weights_path, state, model)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        tie(model.lm_head, model.backbone.embedding)
    return model.to(device=device, dtype=dtype).eval()


class FolderWeights:
    """The model config and full tensors, under our names, of a folder in any form training starts from.

    `kind` says which form: "model folder" (our config + safetensors: ours, a checkpoint, or a
    mamba_ssm export in safetensors), "mamba_ssm folder" (pytorch_model.bin, read with
    weights_only=True and memory-mapped), or transformers' export (config.json with a `model_type`;
    `hf` is True; a tensor of ours may be several of its, as `transformers_formats.file_parts` says, and
    the vocabulary's padding rows our exports leave out read as zeros). `tensors(names)` opens only the
    files holding `names` (of a .bin, only the pages); with tie_embeddings the head is the embedding.
    """

    def __init__(self, directory: str):
        self.directory = directory
        config_path = os.path.join(directory, CONFIG_FILE)
        try:
            with open(config_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"{config_path}: not a readable model config ({e})") from None
        self.model_type = raw.get("model_type") if isinstance(raw, dict) else None
        self.hf = self.model_type is not None
        try:
            self.config = import_config(decode_special_floats(raw)) if self.hf else MambaConfig.from_dict(raw)
        except (ConfigError, HFFormatError, TypeError) as e:
            raise ModelFolderError(f"{config_path}: {e}") from None
        self._torch_file = os.path.join(directory, TORCH_WEIGHTS)
        has_safetensors = any(
            os.path.isfile(os.path.join(directory, n)) for n in (WEIGHTS_FILE, index_file(WEIGHTS_STEM))
        )
        self._bin = None if has_safetensors or not os.path.isfile(self._torch_file) else self._open_bin()
        if self.hf:
            self.kind = f"transformers {architecture(self.model_type)} folder"
        else:
            self.kind = "model folder" if self._bin is None else "mamba_ssm folder (pytorch_model.bin)"

    def _open_bin(self) -> dict:
        try:
            return torch.load(self._torch_file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unpickling refusal or damage: one message
            raise ModelFolderError(
                f"{self._torch_file}: not loadable with weights_only=True and mmap, which refuse "
                f"pickled code and the pre-1.6 format ({' '.join(str(e).split())})"
            ) from None

    def _parts(self, name: str) -> list:
        """The tensors of the folder's files that make up our tensor `name`."""
        return file_parts(self.model_type, self.config, name) if self.hf else [Part(name, None)]

    def shapes(self) -> dict:
        """Our name -> shape of every tensor in the folder (only headers are read; a file's tensor that is part
        of none of ours keeps its own name); a tied head left out."""
        if self._bin is not None:
            held = {n: tuple(t.shape) for n, t in self._bin.items()}
        else:
            with FolderTensors(self.directory, WEIGHTS_STEM) as tensors:
                held = {n: tensors.shape(n) for n in tensors.names()}
        shapes = self._from_file_names(held) if self.hf else held
        if self.config.tie_embeddings:
            shapes.pop(HEAD, None)
        return shapes

    def _from_file_names(self, held: dict) -> dict:
        """transformers' tensor shapes `held` under our names: a tensor of ours made of several of the file's
        has their rows summed, the embedding and head of the real vocabulary its padding rows added; a file's
        tensor that is part of none of ours keeps its own name, unless the format holds it as zeros."""
        shapes, used = {}, set()
        with torch.device("meta"):
            names = [n for n, _ in MambaLM(self.config).named_parameters()]
        for name in file_names(self.model_type, names):
            parts = self._parts(name)
            if all(p.name in held for p in parts):
                shapes[name] = our_shape(self.config, name, held_shape(parts, held))
                used.update(p.name for p in parts)
        used.update(zero_tensors(self.model_type, self.config))
        return {**shapes, **{n: shape for n, shape in held.items() if n not in used}}

    def each(self, names):
        """(name, full tensor) for each of `names`, one at a time, on the CPU (the head is the embedding when tied),
        each checked finite: a caller that keeps only its slice of each holds one full tensor at a time."""
        source = {n: EMBEDDING if self.config.tie_embeddings and n == HEAD else n for n in names}
        if self._bin is not None:
            absent = sorted({p.name for s in source.values() for p in self._parts(s)} - set(self._bin))
            if absent:
                raise ModelFolderError(f"{self._torch_file}: has no tensors {absent[:5]}")
            for n, s in source.items():
                yield n, self._finite(s, self._assemble(s, self._bin.__getitem__))
            return
        with FolderTensors(self.directory, WEIGHTS_STEM) as tensors:
            for n, s in source.items():
                yield n, self._finite(s, self._assemble(s, tensors.read))

    def _assemble(self, name: str, read) -> torch.Tensor:
        """Our tensor `name` from the folder's (of a transformers export: the vocabulary's padding rows zero)."""
        return assemble(self.config, name, self._parts(name), read) if self.hf else read(name)

    def _finite(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        check_finite({name: tensor}, self.directory)
        return tensor

    def tensors(self, names) -> dict:
        """Full tensors by our name for `names`, on the CPU (the head is the embedding when tied)."""
        return dict(self.each(names))
