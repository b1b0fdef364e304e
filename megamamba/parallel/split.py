"""Whether a parallel group splits anything: the one test the layers and the model make; and the one check of a
rank's place in a group (`check_place`)."""

from __future__ import annotations

from typing import Optional, Protocol, TypeVar


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


Group = TypeVar("Group", bound=_Sized)  # a TensorParallel, ContextParallel or ExpertParallel


def check_place(kind: str, group: object, size: int, rank: int) -> None:
    """ValueError unless `rank` is a place in a `kind` ("tensor-parallel", ...) group of `size` ranks, which needs a
    process group when it has more than one."""
    if size < 1:
        raise ValueError(f"{kind} size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{kind} rank {rank} is outside [0, {size})")
    if size > 1 and group is None:
        raise ValueError(f"{kind} size {size} > 1 needs a process group, got None")


def split(group: Optional[Group]) -> Optional[Group]:
    """`group` when it spreads work over more than one rank; None for no group or a single rank,
    which every layer treats as the plain single-device model."""
    return group if group is not None and group.size > 1 else None
