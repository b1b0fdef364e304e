"""How each parameter of a parallel layer relates to its full, layout-free tensor.

Every parameter built by `megamamba.parallel` carries `tensor_model_parallel`, `partition_dim`
and `tp_shard` (a `Shard`); `local_shard` and `assemble_full` are exact inverses, `gather_full` /
`full_tensors` gather across the TP group, `load_full_tensors` slices a full state dict.
Components, replicated parts and vocab padding: docs/code.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megamamba.parallel.tensor.collectives import start_all_gather
from megamamba.parallel.tensor.tensor_parallel import TensorParallel, divide


@dataclass(frozen=True)
class Component:
    """A named block of a full tensor along its split dim; `size` is its full size."""

    name: str
    size: int
    sharded: bool = True


@dataclass(frozen=True)
class Shard:
    """How one local parameter relates to the full tensor `full_name` of its module.

    `dim` None: the parameter is the whole tensor, replicated on every TP rank.
    `components`: the full tensor along `dim`, in order; the parameter holds this rank's slice
    of every sharded component (in order), or, with `replicated_part`, all replicated ones.
    `pad`: rows appended at build time (single-component layouts only), dropped when gathered.
    `grad_reduced`: replicated, with its gradient all-reduced over TP inside backward.
    """

    full_name: str
    dim: int | None
    components: tuple[Component, ...] = ()
    replicated_part: bool = False
    pad: int = 0
    grad_reduced: bool = False

    def __post_init__(self):
        if self.dim is not None and not self.components:
            raise ValueError(f"shard of {self.full_name!r} splits dim {self.dim} but lists no components")
        if self.pad and (len(self.components) != 1 or not self.components[0].sharded):
            raise ValueError(
                f"shard of {self.full_name!r}: padding needs exactly one sharded component, got {self.components}"
            )
        if self.replicated_part and not self.grad_reduced:
            raise ValueError(f"shard of {self.full_name!r}: a replicated component must have its gradient reduced")

    @property
    def sharded(self) -> bool:
        """True when the parameter holds a slice (not a replica) of the full tensor."""
        return self.dim is not None and not self.replicated_part

    def held(self) -> list[Component]:
        """The components this parameter holds, in order."""
        return [c for c in self.components if c.sharded != self.replicated_part]

    def local_sizes(self, tp_size: int) -> list[int]:
        """Size along `dim` of each held component in the local parameter."""
        if self.replicated_part:
            return [c.size for c in self.held()]
        return [divide(c.size + self.pad, tp_size, f"size of {self.full_name}.{c.name}") for c in self.held()]

    def full_rows(self, tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
        """The full tensor's ranges along `dim` held by this rank's parameter, in its order (padding left out)."""
        out, offset = [], 0
        local_sizes = iter(self.local_sizes(tp_size))
        for c in self.components:
            if c.sharded != self.replicated_part:
                size = next(local_sizes)
                start, stop = tp_rank * size, min((tp_rank + 1) * size, c.size)
                if self.replicated_part:
                    start, stop = 0, c.size
                if start < stop:
                    out.append((offset + start, offset + stop))
            offset += c.size
        return out


def mark(param: nn.Parameter, shard: Shard) -> nn.Parameter:
    """Attach the sharding attributes DeepSpeed and our checkpoint code read."""
    param.tp_shard = shard
    param.tensor_model_parallel = shard.sharded
    param.partition_dim = shard.dim if shard.sharded else -1
    return param


def tp_padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocab rounded up to a multiple of the TP size (extra rows exist only when built)."""
    return -(-vocab_size // tp_size) * tp_size


def local_shard(full: torch.Tensor, shard: Shard, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's local parameter cut from the full tensor (no communication)."""
    if shard.dim is None:
        return full.clone()
    expected = sum(c.size for c in shard.components)
    if full.shape[shard.dim] != expected:
        raise ValueError(
            f"{shard.full_name}: full tensor has {full.shape[shard.dim]} along dim {shard.dim}, "
            f"its components {[(c.name, c.size) for c in shard.components]} sum to {expected}"
        )
    blocks = list(full.split([c.size for c in shard.components], dim=shard.dim))
    if shard.pad:
        pad_shape = list(full.shape)
        pad_shape[shard.dim] = shard.pad
        blocks[0] = torch.cat([blocks[0], full.new_zeros(pad_shape)], dim=shard.dim)
    local_sizes = iter(shard.local_sizes(tp_size))
    parts = []
    for c, block in zip(shard.components, blocks):
        if c.sharded == shard.replicated_part:
            continue
        size = next(local_sizes)
        parts.append(block if shard.replicated_part else block.narrow(shard.dim, tp_rank * size, size))
    return torch.cat(parts, dim=shard.dim).clone()


def assemble_full(
    shard: Shard, locals_by_rank: Sequence[torch.Tensor], replicated: torch.Tensor | None = None
) -> torch.Tensor:
    """The full tensor from every TP rank's local parameter (in rank order), no communication.

    `replicated`: the partner parameter holding the replicated components, when there are any.
    """
    if shard.dim is None or shard.replicated_part:
        raise ValueError(f"{shard.full_name}: assemble from the sharded parameter, not a replica")
    tp_size = len(locals_by_rank)
    per_rank = [t.split(shard.local_sizes(tp_size), dim=shard.dim) for t in locals_by_rank]
    has_replicated = any(not c.sharded for c in shard.components)
    if has_replicated != (replicated is not None):
        raise ValueError(
            f"{shard.full_name}: components {[(c.name, c.sharded) for c in shard.components]} "
            f"{'need' if has_replicated else 'have no'} a replicated partner"
        )
    rep_blocks = iter(
        replicated.split([c.size for c in shard.components if not c.sharded], dim=shard.dim)
        if replicated is not None
        else []
    )
    blocks, held_index = [], 0
    for c in shard.components:
        if c.sharded:
            blocks.append(torch.cat([parts[held_index] for parts in per_rank], dim=shard.dim))
            held_index += 1
        else:
            blocks.append(next(rep_blocks))
    full = torch.cat(blocks, dim=shard.dim)
    return full.narrow(shard.dim, 0, full.shape[shard.dim] - shard.pad)


def gather_full(
    local: torch.Tensor, shard: Shard, tp: TensorParallel, replicated: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather a sharded local tensor over TP and assemble the full one (on every rank)."""
    if shard.dim is None:
        return local.detach().clone()
    stacked = start_all_gather(local.detach(), tp, 0).wait()
    locals_by_rank = stacked.chunk(tp.size, 0) if tp.size > 1 else [stacked]
    return assemble_full(shard, locals_by_rank, None if replicated is None else replicated.detach())


def _shard_of(param: nn.Parameter, name: str) -> Shard:
    return getattr(param, "tp_shard", None) or Shard(full_name=name.rsplit(".", 1)[-1], dim=None)


def _full_key(name: str, shard: Shard) -> str:
    prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
    return prefix + shard.full_name


def full_key(name: str, param: nn.Parameter) -> str:
    """The single-device state-dict key of the parameter called `name` in a parallel module
    (`in_proj.weight_replicated` -> `in_proj.weight`)."""
    return _full_key(name, _shard_of(param, name))


def full_tensors(
    module: nn.Module,
    tp: TensorParallel,
    select: Callable[[nn.Parameter], torch.Tensor] = lambda p: p,
) -> dict[str, torch.Tensor]:
    """Full, layout-free tensors of `module`, keyed like its single-device state dict.

    `select` picks what to gather per parameter: the value (default), `lambda p: p.grad`, an
    optimizer moment... Collective: every TP rank must call it; every rank gets the result.
    """
    named = dict(module.named_parameters())
    replicas = {_full_key(n, _shard_of(p, n)): select(p) for n, p in named.items() if _shard_of(p, n).replicated_part}
    out = {}
    for name, param in named.items():
        shard = _shard_of(param, name)
        if shard.replicated_part:
            continue
        key = _full_key(name, shard)
        out[key] = gather_full(select(param), shard, tp, replicas.get(key))
    return out


def load_full_tensors(module: nn.Module, full: Mapping[str, torch.Tensor], tp: TensorParallel) -> None:
    """Copy this rank's shards of a full state dict into `module`'s parameters (no communication)."""
    named = dict(module.named_parameters())
    wanted = {_full_key(n, _shard_of(p, n)) for n, p in named.items()}
    missing, unexpected = sorted(wanted - set(full)), sorted(set(full) - wanted)
    if missing or unexpected:
        raise KeyError(f"full state dict does not match the module: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in named.items():
            shard = _shard_of(param, name)
            local = local_shard(full[_full_key(name, shard)], shard, tp.size, tp.rank)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: shard of the full tensor has shape {tuple(local.shape)}, "
                    f"the parameter {tuple(param.shape)}"
                )
            param.copy_(local)
