"""Parameter names: the pipeline module's <-> mamba_ssm's.

DeepSpeed names a pipeline layer's parameters `<global layer index>.<name>` and a tied module's
`tied_modules.<key>.<name>`. With n = n_layer, the layer list of `pipelines.module` gives

    tied_modules.embed.weight  (tied)   <-> backbone.embedding.weight  (and lm_head.weight)
    0.weight                   (untied) <-> backbone.embedding.weight
    {i+1}.<rest>                        <-> backbone.layers.{i}.<rest>      0 <= i < n
    {n+1}.norm.<rest>                   <-> backbone.norm_f.<rest>
    {n+2}.weight               (untied) <-> lm_head.weight

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
from megamamba.lm import EMBEDDING, HEAD
from megamamba.parallel import TensorParallel, full_key, full_tensors, local_shard

TIED_KEY = "embed"
EMBEDDING_LAYER = 0


def block_layer(i: int) -> int:
    """Global layer index of block i."""
    return i + 1


def final_norm_layer(n_layer: int) -> int:
    return n_layer + 1


def head_layer(n_layer: int) -> int:
    return n_layer + 2


def to_mamba(name: str, config: MambaConfig) -> str:
    """Pipeline-module parameter name -> mamba_ssm name."""
    if name == f"tied_modules.{TIED_KEY}.weight":
        return EMBEDDING
    m = re.fullmatch(r"(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(f"{name!r} is not a pipeline layer parameter name")
    index, rest = int(m.group(1)), m.group(2)
    n = config.n_layer
    if index == EMBEDDING_LAYER and rest == "weight" and not config.tie_embeddings:
        return EMBEDDING
    if 1 <= index <= n:
        return f"backbone.layers.{index - 1}.{rest}"
    if index == final_norm_layer(n) and rest.startswith("norm."):
        return f"backbone.norm_f.{rest[len('norm.'):]}"
    if index == head_layer(n) and rest == "weight" and not config.tie_embeddings:
        return HEAD
    raise KeyError(f"{name!r} names no parameter of a {n}-layer model (tie_embeddings={config.tie_embeddings})")


def to_pipe(name: str, config: MambaConfig) -> str:
    """mamba_ssm name -> pipeline-module parameter name (lm_head.weight is the tied embedding when tied)."""
    if name == EMBEDDING or (name == HEAD and config.tie_embeddings):
        return f"tied_modules.{TIED_KEY}.weight" if config.tie_embeddings else f"{EMBEDDING_LAYER}.weight"
    if name == HEAD:
        return f"{head_layer(config.n_layer)}.weight"
    m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", name)
    if m is not None and int(m.group(1)) < config.n_layer:
        return f"{block_layer(int(m.group(1)))}.{m.group(2)}"
    if name.startswith("backbone.norm_f."):
        return f"{final_norm_layer(config.n_layer)}.norm.{name[len('backbone.norm_f.'):]}"
    raise KeyError(f"{name!r} is not a parameter of a mamba_ssm {config.n_layer}-layer model")


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
def load_full_state(module: nn.Module, state: dict, tp: Optional[TensorParallel] = None,
                    rename: Callable[[str], str] = lambda name: name) -> None:
    """Copy `module`'s parameters (this rank's TP slices under `tp`) out of a full state dict.

    `rename` maps a module parameter's full name to its key in `state`; every parameter must be found.
    """
    for name, param in module.named_parameters():
        key = rename(full_key(name, param))
        if key not in state:
            raise KeyError(f"state dict has no {key!r} (for parameter {name!r})")
        value = state[key]
        if tp is not None and getattr(param, "tp_shard", None) is not None:
            value = local_shard(value, param.tp_shard, tp.size, tp.rank)
        if value.shape != param.shape:
            raise ValueError(f"{key!r}: state dict gives shape {tuple(value.shape)} for parameter {name!r} "
                             f"of shape {tuple(param.shape)}")
        param.copy_(value)


def load_mamba_state_dict(pipe: nn.Module, state: dict, config: MambaConfig,
                          tp: Optional[TensorParallel] = None) -> None:
    """Copy this stage's parameters from a full mamba_ssm-named state dict (TP slices under `tp`)."""
    load_full_state(pipe, state, tp, rename=lambda name: to_mamba(name, config))
