"""Counts every collective the parallel layers issue, so tests and the training log can see it.

`nbytes` is the size of the full tensor of the collective (NCCL-tests' convention): the tensor
for an all-reduce, the gathered output for an all-gather, the input for a reduce-scatter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class CommRecord:
    """One collective: `kind` is all_reduce, all_reduce_max, all_gather or reduce_scatter."""

    kind: str
    nbytes: int
    group_size: int


@dataclass(frozen=True)
class CommTotals:
    calls: int
    nbytes: int


class CommCounter:
    """Running totals per kind since the last `reset`, and exact call lists inside `capture`.

    Thread-safe: on GPU the backward pass (and its collectives) runs on autograd's threads.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._totals: dict[str, CommTotals] = {}
        self._captures: list[list[CommRecord]] = []

    def record(self, kind: str, nbytes: int, group_size: int) -> None:
        entry = CommRecord(kind, nbytes, group_size)
        with self._lock:
            old = self._totals.get(kind, CommTotals(0, 0))
            self._totals[kind] = CommTotals(old.calls + 1, old.nbytes + nbytes)
            for records in self._captures:
                records.append(entry)

    def snapshot(self) -> dict[str, CommTotals]:
        """Calls and bytes per kind since the last reset."""
        with self._lock:
            return dict(self._totals)

    def reset(self) -> None:
        with self._lock:
            self._totals = {}

    @contextmanager
    def capture(self) -> Iterator[list[CommRecord]]:
        """Yield a list that receives every collective issued inside the block, in order."""
        records: list[CommRecord] = []
        with self._lock:
            self._captures.append(records)
        try:
            yield records
        finally:
            with self._lock:
                self._captures = [r for r in self._captures if r is not records]


comm_counter = CommCounter()
"""The process-wide counter every collective in `megamamba.parallel` records into."""
