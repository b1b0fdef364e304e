"""Whether a parallel group splits anything: the one test the layers and the model make."""

from __future__ import annotations

from typing import Optional, Protocol, TypeVar


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


Group = TypeVar("Group", bound=_Sized)  # a TensorParallel, ContextParallel or ExpertParallel


def split(group: Optional[Group]) -> Optional[Group]:
    """`group` when it spreads work over more than one rank; None for no group or a single rank,
    which every layer treats as the plain single-device model."""
    return group if group is not None and group.size > 1 else None
