"""Which transformers format a model converts to and from, and where each of our tensors lies in its files.

Mamba-only models take transformers' Mamba / Mamba2 (hf.py); hybrids (attention or MLP layers, or a
layer pattern) take NemotronH (nemotron_h.py). A tensor of ours is one or more tensors of the file,
its rows in order (`Part`); of the embedding and head the file holds the real vocabulary's rows only, so
transformers' softmax runs over the ids our loss runs over, and reading them back adds the padding rows.
A file may also hold tensors that are none of ours and zero (`zero_tensors`).
"""

from typing import Callable, Optional

import torch

from megamamba.checkpoint import nemotron_h
from megamamba.checkpoint.export_formats import is_hybrid
from megamamba.checkpoint.hf import (
    ARCHITECTURES,
    HF_DEFAULTS,
    VOCABULARY,
    HFFormatError,
    config_from_hf,
    hf_config,
    mamba_parts,
)
from megamamba.checkpoint.nemotron_h_moe import zero_biases
from megamamba.config import MambaConfig

MODEL_TYPES = (*HF_DEFAULTS, nemotron_h.MODEL_TYPE)
GENERATION_CONFIG_FILE = "generation_config.json"


def export_config(config: MambaConfig, dtype: torch.dtype, eos_token_id=None) -> dict:
    """transformers' config.json for `config`; HFFormatError naming what the format cannot represent."""
    if is_hybrid(config):
        return nemotron_h.nemotron_h_config(config, dtype, eos_token_id)
    return hf_config(config, dtype, eos_token_id)


def generation_config(hf: dict, vocab_size: int) -> dict:
    """transformers' generation_config.json beside config.json `hf` for a tokenizer of `vocab_size` ids.

    The ids generation starts and stops at; rows past the tokenizer's ids (a model vocabulary larger than its
    tokenizer's), which `megamamba.generate` never picks, suppressed. The padding rows are not exported.
    """
    ids = {name: hf[name] for name in ("bos_token_id", "eos_token_id")}
    unused = list(range(vocab_size, hf["vocab_size"]))
    return {**ids, "suppress_tokens": unused} if unused else ids


def import_config(hf: dict) -> MambaConfig:
    """Our config for transformers' config.json `hf` (special floats decoded); HFFormatError when we cannot."""
    model_type = hf.get("model_type")
    if model_type == nemotron_h.MODEL_TYPE:
        return nemotron_h.config_from_nemotron_h(hf)
    if model_type in HF_DEFAULTS:
        return config_from_hf(hf)
    raise HFFormatError(
        f"model_type={model_type!r}: only {list(MODEL_TYPES)} (transformers' Mamba, Mamba2, NemotronH) convert"
    )


def architecture(model_type: str) -> str:
    return nemotron_h.ARCHITECTURE if model_type == nemotron_h.MODEL_TYPE else ARCHITECTURES[model_type]


def file_names(model_type: str, names: list) -> list:
    """Our tensor names (`names`: the model's, a tied head left out) that the format's file holds."""
    return nemotron_h.written_names(names) if model_type == nemotron_h.MODEL_TYPE else names


def file_parts(model_type: str, config: MambaConfig, name: str) -> list:
    """[Part] of the file that make up our tensor `name`, rows in order."""
    if model_type == nemotron_h.MODEL_TYPE:
        return nemotron_h.nemotron_h_parts(config, name)
    return mamba_parts(config, name)


def zero_tensors(model_type: Optional[str], config: MambaConfig) -> dict:
    """The file's tensors that are none of ours and hold zeros, name -> shape: written so, and checked so when read."""
    return zero_biases(config) if model_type == nemotron_h.MODEL_TYPE else {}


def held_shape(parts: list, shapes: dict) -> tuple:
    """The shape the file's tensors `parts` (their shapes by name in `shapes`) make together, rows in order."""
    whole = [(1, *shapes[p.name]) if p.stacked else tuple(shapes[p.name]) for p in parts]
    return (sum(shape[0] for shape in whole), *whole[0][1:])


def our_shape(config: MambaConfig, name: str, shape: tuple) -> tuple:
    """The shape of our tensor `name` made of file tensors holding `shape` in all: the embedding and head of the
    real vocabulary with the padding rows added."""
    if name in VOCABULARY and shape[0] == config.vocab_size:
        return (config.padded_vocab_size, *shape[1:])
    return shape


def assemble(config: MambaConfig, name: str, parts: list, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Our tensor `name` from its parts, each read by its name in the file; the vocabulary's padding rows, which
    the file does not hold, zero (they are never trained: no id reaches them and the loss leaves them out)."""
    pieces = [read(p.name).unsqueeze(0) if p.stacked else read(p.name) for p in parts]
    tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    rows = our_shape(config, name, tuple(tensor.shape))[0]
    if rows == tensor.shape[0]:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
