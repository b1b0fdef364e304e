"""The tensor-parallel group a layer works in, handed to every parallel layer explicitly.

Layers never look a group up globally: whoever builds the model passes a `TensorParallel`
(from `megamamba.parallel.groups.ParallelGroups.tensor_parallel`, or the default single-rank
one), so the same layer code runs at any TP size and in single-process tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from megamamba.parallel.split import check_place

SEQ_DIM = 1
"""Activations are (batch, seqlen, hidden); sequence parallelism splits dim 1."""


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in its tensor-parallel group.

    `sequence_parallel`: between blocks the activations are split along the sequence across
    this group (Megatron's sequence parallelism); layers gather/reduce-scatter accordingly.
    The default is one rank, no group: every collective is the identity.
    """

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self):
        check_place("tensor-parallel", self.group, self.size, self.rank)

    def without_sequence_parallel(self) -> TensorParallel:
        """The same group for layers inside a mixer, whose activations span the whole sequence."""
        return dataclasses.replace(self, sequence_parallel=False)


def divide(numerator: int, tp_size: int, what: str) -> int:
    """`numerator / tp_size`, refusing a remainder with a message naming `what`."""
    if numerator % tp_size:
        raise ValueError(f"{what} = {numerator} is not divisible by the tensor-parallel size {tp_size}")
    return numerator // tp_size
