"""The reference ops' gradients inside a backward custom op: the reference forward run again under autograd.

An op's implementation runs below autograd, so the forward op keeps no graph, only its inputs (as the
Triton kernels do); its backward op switches autograd back on, recomputes the reference under the
forward's autocast and differentiates it. In float32 that is exactly the graph autograd would have kept.
"""

import contextlib
from typing import Callable, Optional

import torch
from torch import Tensor


def autocast_to(device_type: str, dtype: Optional[torch.dtype]):
    """Autocast to `dtype` on the device (None: off), whatever the caller's own setting."""
    return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)


@contextlib.contextmanager
def _autograd_on():
    """Autograd (and its view tracking) back on inside an op's implementation, which runs below it."""
    keys = torch._C.DispatchKey
    with (
        torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False),
        torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False),
        torch.enable_grad(),
    ):
        yield


def _owned(t: Tensor, others: list) -> Tensor:
    """t contiguous and sharing memory with none of `others` (an op's outputs never alias its inputs or
    each other, and autograd may hand an output's gradient through unchanged)."""
    t = t.contiguous()
    if any(
        o is not None and o.numel() and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others
    ):
        return t.clone()
    return t


def reference_grads(
    forward: Callable, tensors: dict, options: dict, output_grads: tuple, autocast: Optional[torch.dtype], names: tuple
) -> list:
    """Gradients of forward(**tensors, **options) with respect to tensors[name] for each of `names`
    (None for an absent one), given each output's gradient (None: that output is unused)."""
    leaves = {k: t.detach().requires_grad_() if k in names and t is not None else t for k, t in tensors.items()}
    wanted = [leaves[k] for k in names if leaves[k] is not None]
    device_type = wanted[0].device.type
    with _autograd_on():
        with autocast_to(device_type, autocast):
            outputs = forward(**leaves, **options)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        used = [(o, g) for o, g in zip(outputs, output_grads) if g is not None]
        found = torch.autograd.grad([o for o, _ in used], wanted, [g for _, g in used], allow_unused=True)
    grads = iter(found)
    result: list = []
    taken = list(output_grads)
    for k in names:
        if leaves[k] is None:
            result.append(None)
            continue
        g = next(grads)
        g = torch.zeros_like(leaves[k], memory_format=torch.contiguous_format) if g is None else _owned(g, taken)
        taken.append(g)
        result.append(g)
    return result
