"""Training state as layout-free, name-keyed contents, and back: model, optimizer, scheduler.

Parameters under their mamba_ssm names and full shapes, optimizer state as "<name>/<key>",
the scheduler as JSON; loading keeps the run's hyperparameters. Functions taking `tp` are
collective over its group when tp.size > 1. Details: docs/checkpoints.md.
"""

import json
import warnings
from typing import Mapping, Optional

import torch
from torch import nn

from megamamba.checkpoint.files import CheckpointError
from megamamba.checkpoint.store import CheckpointWarning
from megamamba.model.layers import EMBEDDING, HEAD
from megamamba.parallel import TensorParallel, full_key, full_tensors, load_full_tensors, local_shard, split

_LR_KEYS = ("lr", "initial_lr")


def _named(model: nn.Module) -> dict:
    """Local parameters by local name (a tied parameter once)."""
    return dict(model.named_parameters())


def model_tensors(model: nn.Module, tp: Optional[TensorParallel] = None) -> dict:
    """Full parameters by single-device name, detached (on the parameters' device)."""
    if split(tp):
        return full_tensors(model, tp)
    return {name: p.detach() for name, p in _named(model).items()}


def load_model_tensors(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    tp: Optional[TensorParallel] = None,
    source: str = "checkpoint",
) -> None:
    """Copy full tensors into `model` (this rank's shards under TP); CheckpointError when names or shapes differ."""
    tensors = dict(tensors)
    wanted = {full_key(n, p) for n, p in _named(model).items()}
    if HEAD in tensors and HEAD not in wanted:
        if EMBEDDING in tensors and not torch.equal(tensors[HEAD], tensors[EMBEDDING]):
            raise CheckpointError(f"{source}: {HEAD} differs from {EMBEDDING}, but the model ties them")
        tensors.pop(HEAD)
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: parameters do not match the model: missing {missing}, unexpected {unexpected}"
        )
    if split(tp):
        try:
            load_full_tensors(model, tensors, tp)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
        return
    with torch.no_grad():
        for name, param in _named(model).items():
            if tensors[name].shape != param.shape:
                raise CheckpointError(
                    f"{source}: {name} has shape {tuple(tensors[name].shape)}, the model {tuple(param.shape)}"
                )
            param.copy_(tensors[name])


def _state_keys(optimizer: torch.optim.Optimizer, named: dict) -> tuple:
    """(per-element keys, scalar keys) of the optimizer state, checked to be tensors of those two kinds."""
    elementwise, scalar = set(), set()
    for name, p in named.items():
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.shape == p.shape:
                elementwise.add(key)
            elif torch.is_tensor(value) and value.dim() == 0:
                scalar.add(key)
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} is {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))}: only tensors shaped like the "
                    "parameter or 0-d tensors can be saved"
                )
    return sorted(elementwise), sorted(scalar)


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: nn.Module, tp: Optional[TensorParallel] = None) -> dict:
    """The optimizer state, "<full name>/<key>" -> full tensor (empty before the first step)."""
    named = _named(model)
    elementwise, scalar = _state_keys(optimizer, named)
    out = {}
    for key in elementwise:
        if split(tp):
            gathered = full_tensors(model, tp, select=lambda p, key=key: optimizer.state[p][key])
        else:
            gathered = {n: optimizer.state[p][key].detach() for n, p in named.items()}
        out.update({f"{name}/{key}": t for name, t in gathered.items()})
    for key in scalar:
        for name, p in named.items():
            out[f"{full_key(name, p)}/{key}"] = optimizer.state[p][key].detach()
    return out


EXPERT_GROUP_KEYS = ("moe", "name")  # mark a group of experts split over an expert-parallel group


def optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module, members: Optional[list] = None) -> list:
    """Each param group's hyperparameters (JSON) with "params": the full names of its members. A group of split
    experts (`EXPERT_GROUP_KEYS`, as expert parallelism makes them) counts as part of the group it was split from,
    so that the groups do not depend on the expert-parallel size.

    members: the model parameters of each group when the optimizer steps other tensors (DeepSpeed's
    ZeRO optimizer steps flat partitions: pass its `bit16_groups`).
    """
    names = {id(p): full_key(n, p) for n, p in _named(model).items()}
    groups: list = []
    for i, group in enumerate(optimizer.param_groups):
        params = group["params"] if members is None else members[i]
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise CheckpointError(
                f"optimizer group {i} steps {len(unknown)} tensor(s) that are not parameters of the "
                "model (pass `members` for an optimizer over flat partitions)"
            )
        hyper = json.loads(json.dumps({k: v for k, v in group.items() if k not in ("params", *EXPERT_GROUP_KEYS)}))
        members_named = list(dict.fromkeys(names[id(p)] for p in params))
        if group.get("moe"):  # experts split from an earlier group with the same hyperparameters: that group's
            twin = next(g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper)
            twin["params"] += members_named
        else:
            groups.append({**hyper, "params": members_named})
    return groups


def check_optimizer_groups(saved: list, run: list) -> None:
    """CheckpointError when the groups hold other parameters; a warning naming changed hyperparameters (lr aside)."""
    if len(saved) != len(run):
        raise CheckpointError(f"checkpoint optimizer has {len(saved)} parameter groups, the run {len(run)}")
    for i, (s, r) in enumerate(zip(saved, run)):
        if set(s["params"]) != set(r["params"]):
            diff = sorted(set(s["params"]) ^ set(r["params"]))
            raise CheckpointError(f"optimizer group {i}: parameters differ between checkpoint and run: {diff[:5]}")
        changed = [
            f"{k}: checkpoint {s.get(k)!r}, run {r.get(k)!r}"
            for k in sorted(set(s) | set(r))
            if k not in (*_LR_KEYS, "params") and s.get(k) != r.get(k)
        ]
        if changed:
            warnings.warn(
                f"optimizer group {i} hyperparameters differ from the checkpoint, the run's apply: "
                + "; ".join(changed),
                CheckpointWarning,
                stacklevel=3,
            )


def _local(t: torch.Tensor, param: nn.Parameter, tp: Optional[TensorParallel]) -> torch.Tensor:
    """This rank's part of a saved optimizer state tensor (a 0-d one whole)."""
    shard = getattr(param, "tp_shard", None)
    return local_shard(t, shard, tp.size, tp.rank) if t.dim() and split(tp) and shard is not None else t


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    saved_groups: list,
    tp: Optional[TensorParallel] = None,
) -> None:
    """Restore the state `optimizer_tensors` saved (this rank's shards under TP), keeping the run's hyperparameters."""
    saved: dict = {}
    for key_name, t in tensors.items():
        name, _, key = key_name.rpartition("/")
        saved.setdefault(name, {})[key] = t
    named = _named(model)
    unexpected = sorted(set(saved) - {full_key(n, p) for n, p in named.items()})
    if unexpected:
        raise CheckpointError(f"checkpoint optimizer state does not match the model: unexpected {unexpected[:5]}")
    restore_optimizer_state(
        optimizer,
        model,
        {n: {key: _local(t, p, tp) for key, t in saved.get(full_key(n, p), {}).items()} for n, p in named.items()},
        saved_groups,
    )


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer, model: nn.Module, state: Mapping[str, dict], saved_groups: list
) -> None:
    """Restore per-parameter state, `state[local parameter name] = {key: tensor shaped like that parameter, or
    0-d}`, for every parameter the optimizer steps or none (saved before the first step), keeping the run's
    hyperparameters; frozen parameters (the expert biases) have none. A 0-d state is copied per parameter: AdamW
    increments `step` in place, and the sharded and replicated parts of one tensor may be given the same one."""
    check_optimizer_groups(saved_groups, optimizer_groups(optimizer, model))
    if not any(state.values()):
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = {n: p for n, p in _named(model).items() if id(p) in stepped}
    missing = sorted(n for n in named if not state.get(n))
    if missing:
        raise CheckpointError(f"checkpoint optimizer state does not match the model: missing {missing[:5]}")
    for n, p in named.items():
        for key, t in state[n].items():
            if t.dim() and t.shape != p.shape:
                raise CheckpointError(
                    f"checkpoint optimizer state {n}/{key} has shape {tuple(t.shape)}, which does "
                    f"not fit the parameter {tuple(p.shape)}"
                )
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    restored = {
        index[id(p)]: {key: t.clone() if t.dim() == 0 else t for key, t in state[n].items()} for n, p in named.items()
    }
    optimizer.load_state_dict({"state": restored, "param_groups": optimizer.state_dict()["param_groups"]})


def adam_step(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """AdamW's `step` as torch creates it for `param` in `group`: float32 on the parameter's device when fused
    or capturable (the update reads it there, without a host sync), else a host tensor of the default scalar dtype."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(step), dtype=dtype)


def scheduler_state(scheduler) -> dict:
    """A torch LR scheduler's state_dict, checked to be JSON."""
    state = scheduler.state_dict()
    try:
        return json.loads(json.dumps(state))
    except TypeError as e:
        raise CheckpointError(f"scheduler state of {type(scheduler).__name__} is not JSON ({e})") from None


def load_scheduler_state(scheduler, state: Optional[dict], step: int) -> None:
    """Restore a scheduler and set each group's lr to its restored last lr (used by the next step).

    A checkpoint saved without scheduler state (scheduler=None) puts the schedule where `step`
    optimizer steps would have taken it: one `step()` from epoch step - 1.
    """
    if state is None:
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # a step() before the optimizer's warns; here it is the point
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    else:
        scheduler.load_state_dict(dict(state))
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
