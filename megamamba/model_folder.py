"""A model folder: `config.json` + `model.safetensors` (+ the tokenizer's files), read without unpickling.

The weights carry mamba_ssm's names and full shapes (`backbone.embedding.weight`, ...,
`lm_head.weight`), the vocabulary padded as mamba_ssm pads it. With tied embeddings the head
is the embedding and `lm_head.weight` may be left out (safetensors stores no shared tensors);
when present it must equal the embedding. Tokenizer files are whatever `tokenizer.save`
writes (tokenizer.model, tokenizer.json, tokenizer_config.json); `load_tokenizer(folder)` reads them.
"""
import os
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megamamba.config import MambaConfig
from megamamba.lm import MambaLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEAD_KEY, EMBEDDING_KEY = "lm_head.weight", "backbone.embedding.weight"


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded; the message names the file or tensor."""


def save_model_folder(model: MambaLM, directory: str, tokenizer=None) -> None:
    """Write config.json, model.safetensors (head left out when tied) and the tokenizer's files."""
    os.makedirs(directory, exist_ok=True)
    model.config.to_json(os.path.join(directory, CONFIG_FILE))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state[HEAD_KEY]
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
    if model.config.tie_embeddings and HEAD_KEY in state:
        if EMBEDDING_KEY in state and not torch.equal(state[HEAD_KEY], state[EMBEDDING_KEY]):
            raise ModelFolderError(f"{path}: tie_embeddings is true but {HEAD_KEY} differs from {EMBEDDING_KEY}")
        state.pop(HEAD_KEY)
    missing = sorted(set(expected) - set(state) - ({HEAD_KEY} if model.config.tie_embeddings else set()))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelFolderError(f"{path}: tensors do not match the config: missing {missing}, unexpected {unexpected}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ModelFolderError(f"{path}: {key} has shape {tuple(tensor.shape)}, the config implies "
                                   f"{tuple(expected[key].shape)}")


def load_model_folder(directory: str, device=None, dtype: Optional[torch.dtype] = None) -> MambaLM:
    """The model of a folder, in eval mode, on `device`, in `dtype` (None keeps the stored dtypes)."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelFolderError(f"{config_path}: no such file (a model folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = MambaConfig.from_json(config_path)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    state = read_weights(weights_path)
    with torch.device("meta"):
        model = MambaLM(config)
    _check_keys(weights_path, state, model)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    return model.to(device=device, dtype=dtype).eval()
