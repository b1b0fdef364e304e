"""Parameter names: the pipeline module's <-> mamba_ssm's.

DeepSpeed names a pipeline layer's parameters `<layer index>.<name>` and a tied module's
`tied_modules.<key>.<name>`; the index is the model's layer number (`megamamba.model.layers`), whose
`layer_prefix` gives the mamba_ssm name: `{i}.<rest>` <-> `layer_prefix(i) + <rest>`, and
`tied_modules.embed.weight` <-> backbone.embedding.weight (and lm_head.weight) when tied.
Indices are global, so the names do not depend on the number of stages; a stage holds a subset.
Anything saved uses mamba_ssm's names (docs/architecture.md), whatever the engine. Under tensor parallelism a
parameter may be a slice of its full tensor or a part of it under another local name
(`in_proj.weight_replicated`); `megamamba.parallel.full_key` gives the full tensor's name, which
these functions then map.
"""

import re
from typing import Callable, Optional

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.layers import EMBEDDING, HEAD, layer_of, layer_prefix
from megamamba.parallel import TensorParallel, full_key, full_tensors
from megamamba.parallel.local_part import local_part

TIED_KEY = "embed"


def to_mamba(name: str, config: MambaConfig) -> str:
    """Pipeline-module parameter name -> mamba_ssm name."""
    if name == f"tied_modules.{TIED_KEY}.weight":
        return EMBEDDING
    m = re.fullmatch(r"(\d+)\.(.+)", name)
    if m is not None:
        index, rest = int(m.group(1)), m.group(2)
        try:
            mamba = layer_prefix(config, index) + rest
            if layer_of(mamba, config) == index and to_pipe(mamba, config) == name:
                return mamba
        except KeyError:
            pass
    raise KeyError(
        f"{name!r} names no parameter of a {config.n_layer}-layer model (tie_embeddings={config.tie_embeddings})"
    )


def to_pipe(name: str, config: MambaConfig) -> str:
    """mamba_ssm name -> pipeline-module parameter name (lm_head.weight is the tied embedding when tied)."""
    index = layer_of(name, config)
    if config.tie_embeddings and name in (EMBEDDING, HEAD):
        return f"tied_modules.{TIED_KEY}.weight"
    return f"{index}.{name[len(layer_prefix(config, index)) :]}"


def mamba_state_dict(pipe: nn.Module, config: MambaConfig, tp: Optional[TensorParallel] = None) -> dict:
    """This stage's parameters as full tensors under mamba_ssm's names (lm_head.weight added where the
    tied embedding is). Under TP the full tensors are gathered: every TP rank must call it."""
    if tp is None:
        state = {to_mamba(name, config): p for name, p in pipe.named_parameters()}
    else:
        state = {to_mamba(name, config): t for name, t in full_tensors(pipe, tp).items()}
    if config.tie_embeddings and EMBEDDING in state:
        state[HEAD] = state[EMBEDDING]
    return state


@torch.no_grad()
def load_full_state(
    module: nn.Module,
    state: dict,
    tp: Optional[TensorParallel] = None,
    rename: Callable[[str], str] = lambda name: name,
) -> None:
    """Copy `module`'s parameters (this rank's TP slices under `tp`, its experts) out of a full state dict.

    `rename` maps a module parameter's full name to its key in `state`; every parameter must be found.
    """
    for name, param in module.named_parameters():
        key = rename(full_key(name, param))
        if key not in state:
            raise KeyError(f"state dict has no {key!r} (for parameter {name!r})")
        value = local_part(state[key], param, tp)
        if value.shape != param.shape:
            raise ValueError(
                f"{key!r}: state dict gives shape {tuple(value.shape)} for parameter {name!r} "
                f"of shape {tuple(param.shape)}"
            )
        param.copy_(value)


def load_mamba_state_dict(
    pipe: nn.Module, state: dict, config: MambaConfig, tp: Optional[TensorParallel] = None
) -> None:
    """Copy this stage's parameters from a full mamba_ssm-named state dict (TP slices under `tp`)."""
    load_full_state(pipe, state, tp, rename=lambda name: to_mamba(name, config))
