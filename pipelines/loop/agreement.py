"""Numbers the ranks agree on, and host data moved to the device, without stalling the device.

NCCL takes only tensors on the current accelerator device; gloo takes host tensors too, so a
host tensor in a collective passes every CPU run and crashes the first GPU one. Every scalar the
ranks agree on (step loss, stop and non-finite flags, peak memory, validation loss) goes through
`agree`: made on `device()` without a host copy, reduced in one collective, read back with one
host synchronization. `to_device` moves a host batch without waiting for the device's queue.
"""

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def device() -> torch.device:
    """The accelerator device of this rank (the CPU on a machine without one)."""
    return torch.device(get_accelerator().current_device_name())


def to_device(t: torch.Tensor) -> torch.Tensor:
    """`t` on `device()`; a host tensor is copied from pinned memory without a host synchronization."""
    target = device()
    if t.device.type == "cpu" and target.type == "cuda":
        t = t.pin_memory()
    return t.to(target, non_blocking=True)


def on_device(values: Sequence[Union[float, torch.Tensor]]) -> torch.Tensor:
    """float64 vector of `values` on `device()`: tensors are cast there, numbers are filled in (no copy)."""
    target = device()
    return torch.stack(
        [
            v.detach().to(target, torch.float64).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=torch.float64, device=target)
            for v in values
        ]
    )


def agree(
    values: Sequence[Union[float, torch.Tensor]], op: str = "sum", group: Optional[dist.ProcessGroup] = None
) -> list:
    """`values` reduced over `group` (default: every rank) by `op` ("sum" or "max") in one all-reduce,
    returned as floats after one host synchronization."""
    if op not in _OPS:
        raise ValueError(f"agree: op {op!r} is not one of {sorted(_OPS)}")
    reduced = on_device(values)
    dist.all_reduce(reduced, op=_OPS[op], group=group)
    return reduced.tolist()
