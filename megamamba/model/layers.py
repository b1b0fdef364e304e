"""The model as one list of layers, numbered 0 .. n_layer + 2, and how each is built.

0 the embedding, i + 1 block i (a Mamba, attention or MLP block, `MambaConfig.block_kinds`),
n_layer + 1 the final norm, n_layer + 2 the head (with tie_embeddings, the embedding's weight). Every
layer takes and returns the residual stream (`megamamba.model.stream`) and is built as
`cls(config, **layer_arguments(...))`: `tp=`, `cp=`, and `ep=` for a kind holding experts. A layer's number
is its initialisation stream, its pipeline layer index and, through `layer_prefix`, its mamba_ssm names.
"""

import contextlib
from typing import Optional

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.embedding import EMBEDDING_TYPE
from megamamba.model.layer_types.final_norm import FINAL_NORM_TYPE
from megamamba.model.layer_types.head import HEAD_TYPE
from megamamba.parallel import TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel
from megamamba.parallel.tensor.from_full import sharded

EMBEDDING, HEAD = "backbone.embedding.weight", "lm_head.weight"  # mamba_ssm's keys


def layer_kinds(config: MambaConfig) -> list:
    """The layer numbering: what each index of the list is (a block by its kind: "mamba", "attention", "mlp")."""
    return [EMBEDDING_TYPE.kind, *config.block_kinds, FINAL_NORM_TYPE.kind, HEAD_TYPE.kind]


def _kind(config: MambaConfig, index: int) -> str:
    kinds = layer_kinds(config)
    if not 0 <= index < len(kinds):
        raise ValueError(f"layer {index}: a {config.n_layer}-layer model has layers 0 .. {len(kinds) - 1}")
    return kinds[index]


def layer_count(config: MambaConfig) -> int:
    """Layers in the list, the head counted whether tied or not."""
    return len(layer_kinds(config))


def layer_class(config: MambaConfig, index: int, tp: Optional[TensorParallel] = None) -> type:
    """The class of layer `index` (its TP form under `tp`)."""
    return layer_type(_kind(config, index)).layer_class(config, split(tp))


def layer_arguments(
    config: MambaConfig,
    index: int,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
    ep: Optional[ExpertParallel] = None,
) -> dict:
    """The groups layer `index` is built with: `tp` and `cp`, and `ep` when its kind holds experts."""
    arguments: dict = dict(tp=tp, cp=cp)
    if layer_type(_kind(config, index)).holds_experts:
        arguments["ep"] = ep
    return arguments


def conv_width(config: MambaConfig) -> int:
    """The widest causal conv of the layers (`LayerType.conv_width`), whose width - 1 tokens a context-parallel
    slice hands the next."""
    return max(layer_type(kind).conv_width(config) for kind in set(layer_kinds(config)))


def check_layout(config: MambaConfig, tp_size: int) -> None:
    """Refuse (LayoutError) a config whose layers cannot be split across `tp_size` ranks."""
    for kind in dict.fromkeys(layer_kinds(config)):
        layer_type(kind).check_layout(config, tp_size)


def layer_prefix(config: MambaConfig, index: int) -> str:
    """The mamba_ssm name prefix of layer `index`'s parameters (a tied head has none of its own)."""
    try:
        kind = layer_type(_kind(config, index))
    except ValueError as e:
        raise KeyError(str(e)) from None
    if kind.tied(config):
        raise KeyError(f"layer {index}: the tied head of a {config.n_layer}-layer model holds the embedding's weight")
    return kind.state_prefix(index)


def layer_of(name: str, config: MambaConfig) -> int:
    """The layer holding the mamba_ssm-named parameter `name` (a tied lm_head.weight is the embedding's)."""
    if name == HEAD and config.tie_embeddings:
        return 0  # the embedding's weight
    for index, kind in enumerate(layer_kinds(config)):
        prefix = layer_type(kind).state_prefix(index)
        if name.startswith(prefix) and layer_type(kind).holds(name[len(prefix) :]):
            return index
    raise KeyError(f"{name!r} is not a parameter of a mamba_ssm {config.n_layer}-layer model")


def draw_seed(device=None) -> int:
    """The one number a model's initialisation takes from the global random stream; none for a model
    built on the meta device (shapes only), so reading a config's shapes leaves the stream alone."""
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type == "meta":
        return 0
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))


@contextlib.contextmanager
def layer_stream(seed: int, index: int, device):
    """The random stream of one layer: the CPU's (and the build device's, on CUDA) generator, seeded from
    (seed, index); the global streams are left as they were."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        layer_seed = (seed * 1_000_003 + index) % 2**63
        torch.random.default_generator.manual_seed(layer_seed)
        if cuda:
            torch.cuda.manual_seed(layer_seed)
        yield


def _construct(
    config: MambaConfig,
    index: int,
    device,
    dtype,
    tp: Optional[TensorParallel],
    cp: Optional[ContextParallel],
    ep: Optional[ExpertParallel],
) -> nn.Module:
    """Layer `index` with its constructor's draws; under TP a kind `drawn_whole` draws its full tensors as one
    device would, then keeps this rank's rows."""
    kind = layer_type(_kind(config, index))
    cls = kind.layer_class(config, tp)
    if tp is not None and kind.drawn_whole:
        full = kind.layer_class(config, None)(config, device=device, dtype=dtype)
        return sharded(full, lambda: cls(config, tp), tp)
    return cls(config, **layer_arguments(config, index, tp, cp, ep), device=device, dtype=dtype)


@torch.no_grad()
def build_layer(
    config: MambaConfig,
    index: int,
    seed: int,
    device=None,
    dtype=None,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
    ep: Optional[ExpertParallel] = None,
) -> nn.Module:
    """Layer `index` initialised from `seed` as mamba_ssm initialises it (under `tp` this rank's shards of
    the same values, under `ep` its experts; a block built with `cp` works on a slice of the sequence, with the
    same values)."""
    tp = split(tp)
    with layer_stream(seed, index, device):
        module = _construct(config, index, device, dtype, tp, cp, ep)
        layer_type(_kind(config, index)).initialise(module, config, tp)
    return module


def initial_layer(config: MambaConfig, index: int, seed: int) -> dict:
    """The full single-device tensors of one layer, under mamba_ssm's names, as `MambaLM` built from
    `seed` holds them."""
    prefix = layer_prefix(config, index)
    state = {prefix + k: v for k, v in build_layer(config, index, seed).state_dict().items()}
    if index == 0 and config.tie_embeddings:  # the embedding's weight is the tied head's too
        state[HEAD] = state[EMBEDDING]
    return state
