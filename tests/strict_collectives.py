"""Strict mode for multi-rank tests: what NCCL on a GPU refuses, refused on gloo too.

gloo takes host tensors in every collective; NCCL takes only tensors on the current CUDA
device ("No backend type associated with device type cpu"). On this CPU machine host and
"device" tensors are the same kind, so strict mode tells them apart by where they came from:

- A tensor is *host* when project code (megamamba, its kernels and pipelines, launch/) made it
  with a factory (`torch.tensor`, `torch.zeros`, `torch.from_numpy`, ...) without naming a
  device, or with `.cpu()`; results of operations whose tensor inputs are all host are host;
  `.to(device)` / `.cuda()` / `.to(other_tensor)` give device tensors. Tensors of torch,
  DeepSpeed and the tests are device tensors.
- A tensor collective (all-reduce, broadcast, all-gather, reduce-scatter, send/recv, ...) given a
  host tensor raises `StrictCollectiveError` naming where the tensor was made.
- An object collective (`all_gather_object`, `gather_object`, `broadcast_object_list`, ...)
  whose pickled payload exceeds `OBJECT_CAP` bytes raises: under NCCL each payload is pickled
  onto the GPU and rank 0 allocates world size x the largest one, so only metadata may go there.

The same torch-function mode counts host synchronizations made by project code (`.item()`,
`.tolist()`, `bool()`/`float()`/`int()` of a tensor, `.cpu()`, `.numpy()`, blocking copies of
host tensors to the device and `torch.tensor(..., device=...)`), which the sync-count test reads.

`install()` turns it on for the rest of the process: `tests/distributed.run_ranks` does so in
every spawned rank (unless strict=False), and `tests/strict_site/sitecustomize.py` in every
Python process a test launches with MEGAMAMBA_STRICT_COLLECTIVES=1 (tests/conftest.py sets it).
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ENV = "MEGAMAMBA_STRICT_COLLECTIVES"
OBJECT_CAP = 64 * 1024
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_PATHS = [os.path.join(_ROOT, d) + os.sep for d in ("megamamba", "kernels", "pipelines", "launch")]
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SITE = "_megamamba_host_site"

TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
OBJECT_COLLECTIVES = {  # name -> the argument that carries this rank's payload
    "all_gather_object": "obj",
    "gather_object": "obj",
    "broadcast_object_list": "object_list",
    "scatter_object_list": "scatter_object_input_list",
    "send_object_list": "object_list",
}
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
    torch.from_numpy,
}
SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
_DEVICE_MOVES = {torch.Tensor.to, torch.Tensor.cuda}


class StrictCollectiveError(RuntimeError):
    """A collective got what NCCL would refuse (a host tensor) or choke on (a large object)."""


def _caller() -> str | None:
    """file:line of the first frame outside torch and this file, when it is project code."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(tuple(PROJECT_PATHS)):
        return None
    return f"{os.path.relpath(frame.f_code.co_filename, _ROOT)}:{frame.f_lineno}"


def treat_as_project(path: str) -> None:
    """Judge the code of file `path` as project code (for tests that plant a bug)."""
    PROJECT_PATHS.append(os.path.abspath(path))


def host_site(t) -> str | None:
    """Where project code made `t` as a host tensor, None for a device tensor."""
    return getattr(t, _SITE, None) if isinstance(t, torch.Tensor) else None


def _mark(result, site: str) -> None:
    for t in tree_flatten(result)[0]:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            setattr(t, _SITE, site)


def _names_device(func, args, kwargs) -> bool:
    if func is torch.Tensor.cuda:
        return True
    if "device" in kwargs or isinstance(kwargs.get("other"), torch.Tensor):
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])


class StrictMode(TorchFunctionMode):
    """Marks host tensors (module docstring) and counts project code's host synchronizations."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES:
            site = _caller()
            if site is not None:
                if "device" not in kwargs:
                    _mark(result, site)
                elif func in (torch.tensor, torch.as_tensor):
                    self.syncs.append(f"{site} {func.__name__}(..., device=...)")
            return result
        if func in SYNCS:
            site = _caller()
            if site is not None:
                self.syncs.append(f"{site} {func.__name__}")
            if func is torch.Tensor.cpu and site is not None:
                _mark(result, site)
            return result
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        sites = [host_site(t) for t in tensors]
        if func in _DEVICE_MOVES and _names_device(func, args, kwargs):
            if sites and sites[0] is not None:
                site = _caller()
                if site is not None and not kwargs.get("non_blocking", False):
                    self.syncs.append(f"{site} blocking copy of a host tensor made at {sites[0]}")
                if result is args[0]:  # on the CPU the move is a no-op; on a GPU it makes a new tensor
                    result = result.view_as(result)
            return result
        if sites and all(s is not None for s in sites):
            _mark(result, sites[0])
        return result


MODE: StrictMode | None = None
_UNWRAPPED: dict = {}  # (module, name) -> the collective install() wrapped


def _check_tensors(name: str, args, kwargs) -> None:
    for t in tree_flatten((args, kwargs))[0]:
        site = host_site(t)
        if site is not None:
            raise StrictCollectiveError(
                f"dist.{name} got a host tensor made at {site} without a device: NCCL takes only tensors on "
                "the current accelerator device (make it with device=get_accelerator().current_device_name())"
            )


def _check_object(name: str, payload) -> None:
    size = len(pickle.dumps(payload))
    if size > OBJECT_CAP:
        raise StrictCollectiveError(
            f"dist.{name} carries a {size}-byte object (cap {OBJECT_CAP}): under NCCL object collectives are "
            "pickled onto the GPU and rank 0 allocates world size x the largest payload; move data as tensors "
            "or files and keep object collectives to small metadata"
        )


def _wrap_tensor_collective(name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        _check_tensors(name, args, kwargs)
        return original(*args, **kwargs)

    return collective


def _wrap_object_collective(name: str, argument: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        payload = signature.bind(*args, **kwargs).arguments.get(argument)
        if payload is not None:
            _check_object(name, payload)
        return original(*args, **kwargs)

    return collective


def install() -> StrictMode:
    """Turn strict mode on in this process (idempotent); returns the mode that counts syncs."""
    global MODE
    if MODE is not None:
        return MODE
    from torch.distributed import distributed_c10d

    for module in (dist, distributed_c10d):
        for name in TENSOR_COLLECTIVES:
            if hasattr(module, name):
                original = _UNWRAPPED[module, name] = getattr(module, name)
                setattr(module, name, _wrap_tensor_collective(name, original))
        for name, argument in OBJECT_COLLECTIVES.items():
            if hasattr(module, name):
                original = _UNWRAPPED[module, name] = getattr(module, name)
                setattr(module, name, _wrap_object_collective(name, argument, original))
    MODE = StrictMode()
    MODE.__enter__()
    return MODE


def uninstall() -> None:
    """Turn strict mode off in this process again: the torch-function mode left, the collectives unwrapped."""
    global MODE
    if MODE is None:
        return
    MODE.__exit__(None, None, None)
    for (module, name), original in _UNWRAPPED.items():
        setattr(module, name, original)
    _UNWRAPPED.clear()
    MODE = None
