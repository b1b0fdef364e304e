"""Pieces of full tensors as the ranks hold them, and the full (or any other rank's) tensor put back from them.

A `Cut` is a rank's TP rows of a full tensor, a `Piece` also its ZeRO fragment; `assemble` builds
any layout's cut from the stored pieces that overlap it. Details: docs/checkpoints.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

Rows = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Cut:
    """A local tensor of shape `shape`: along `dim` the full tensor's `rows` ranges in order, then padding rows."""

    dim: int
    rows: Rows
    shape: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int], dim: int = 0) -> Cut:
        """The whole tensor of `shape`, as rows along `dim`."""
        return Cut(dim, ((0, shape[dim]),), tuple(shape))

    def along(self, dim: int, full: Sequence[int]) -> Cut:
        """The same cut of a tensor of shape `full` as rows along `dim`: possible when one of the two is whole."""
        if dim == self.dim:
            return self
        if self != Cut.whole(full, self.dim):
            raise ValueError(f"a cut along dim {self.dim} (rows {self.rows}) is read as a cut along dim {dim}")
        return Cut.whole(full, dim)

    def placed(self) -> list[tuple[int, int, int]]:
        """(full start, full stop, local start) of each range of rows."""
        out, local = [], 0
        for start, stop in self.rows:
            out.append((start, stop, local))
            local += stop - start
        return out


@dataclass(frozen=True)
class Piece:
    """A stored tensor: the local tensor `cut` of the full tensor `name` (shape `shape`), or with `flat`
    only elements [start, stop) of that local tensor flattened."""

    name: str
    shape: tuple[int, ...]
    cut: Cut
    flat: Optional[tuple[int, int]] = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (self.flat[1] - self.flat[0],) if self.flat else self.cut.shape

    def record(self) -> dict:
        record = {
            "name": self.name,
            "shape": list(self.shape),
            "dim": self.cut.dim,
            "rows": [list(r) for r in self.cut.rows],
            "local_shape": list(self.cut.shape),
        }
        return record | ({"flat": list(self.flat)} if self.flat else {})

    @staticmethod
    def from_record(record: dict, where: str) -> Piece:
        """The piece a record describes; ValueError naming `where` when it is not a consistent piece."""
        try:
            piece = Piece(
                str(record["name"]),
                tuple(int(n) for n in record["shape"]),
                Cut(
                    int(record["dim"]),
                    tuple((int(a), int(b)) for a, b in record["rows"]),
                    tuple(int(n) for n in record["local_shape"]),
                ),
                tuple(int(n) for n in record["flat"]) if "flat" in record else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{where}: piece record {record!r} is malformed ({e!r}); each is {{name, shape, dim, "
                "rows, local_shape[, flat]}"
            ) from None
        problem = piece.problem()
        if problem:
            raise ValueError(f"{where}: piece of {piece.name}: {problem}")
        return piece

    def problem(self) -> Optional[str]:
        """What makes this piece impossible, or None."""
        cut, full = self.cut, self.shape
        if not 0 <= cut.dim < len(full) or len(cut.shape) != len(full):
            return f"dim {cut.dim} or local shape {cut.shape} does not fit the full shape {full}"
        if any(cut.shape[d] != full[d] for d in range(len(full)) if d != cut.dim):
            return f"local shape {cut.shape} differs from the full shape {full} outside dim {cut.dim}"
        if (
            any(not 0 <= a < b <= full[cut.dim] for a, b in cut.rows)
            or sum(b - a for a, b in cut.rows) > cut.shape[cut.dim]
        ):
            return f"rows {cut.rows} are not ranges of the full {full[cut.dim]} that fit the local {cut.shape}"
        if self.flat and not 0 <= self.flat[0] < self.flat[1] <= math.prod(cut.shape):
            return f"flat range {self.flat} is not inside the local tensor of {math.prod(cut.shape)} elements"
        return None


def check_cover(name: str, pieces: Sequence[Piece]) -> None:
    """ValueError unless `pieces` hold every element of the full tensor `name` exactly once."""
    if len({(p.shape, p.cut.dim) for p in pieces}) != 1:
        raise ValueError(
            f"{name}: pieces disagree on the full shape or the split dim: "
            f"{sorted({(p.shape, p.cut.dim) for p in pieces})}"
        )
    by_cut: dict[Cut, list[Piece]] = {}
    for p in pieces:
        by_cut.setdefault(p.cut, []).append(p)
    for cut, held in by_cut.items():
        if any(p.flat is None for p in held):
            if len(held) > 1:
                raise ValueError(f"{name}: the local tensor with rows {cut.rows} is stored {len(held)} times")
            continue
        ranges = sorted(p.flat for p in held)
        ends = [0] + [stop for _, stop in ranges]
        if any(start != end for (start, _), end in zip(ranges, ends)) or ends[-1] != math.prod(cut.shape):
            raise ValueError(
                f"{name}: fragments {ranges} of the local tensor with rows {cut.rows} do not tile its "
                f"{math.prod(cut.shape)} elements"
            )
    rows = sorted(r for cut in by_cut for r in cut.rows)
    size = pieces[0].shape[pieces[0].cut.dim]
    ends = [0] + [stop for _, stop in rows]
    if any(start != end for (start, _), end in zip(rows, ends)) or ends[-1] != size:
        raise ValueError(
            f"{name}: the pieces' rows {rows} along dim {pieces[0].cut.dim} do not cover 0..{size} exactly once"
        )


Read = Callable[[int, int, int], torch.Tensor]
"""read(dim, start, stop): a stored piece's tensor narrowed to start..stop along dim."""


def _overlaps(source: Cut, target: Cut) -> list[tuple[int, int, int]]:
    """(source local row, target local row, count) of every row both cuts hold."""
    out = []
    for s_start, s_stop, s_local in source.placed():
        for t_start, t_stop, t_local in target.placed():
            start, stop = max(s_start, t_start), min(s_stop, t_stop)
            if start < stop:
                out.append((s_local + start - s_start, t_local + start - t_start, stop - start))
    return out


def _local_rows(cut: Cut, fragments: Sequence[tuple[Piece, Read]], first: int, last: int) -> torch.Tensor:
    """Rows first..last (along dim 0) of the local tensor `cut`, from its flat fragments (the whole tensor
    when the cut is along another dim: its rows are strided in the flat order)."""
    if cut.dim != 0:
        first, last = 0, cut.shape[0]
    row = math.prod(cut.shape[1:])
    lo, hi = first * row, last * row
    out = None
    for piece, read in fragments:
        start, stop = max(piece.flat[0], lo), min(piece.flat[1], hi)
        if start < stop:
            part = read(0, start - piece.flat[0], stop - piece.flat[0])
            out = part.new_zeros(hi - lo) if out is None else out
            out[start - lo : stop - lo] = part
    return out.view(last - first, *cut.shape[1:])


def assemble(stored: Sequence[tuple[Piece, Read]], target: Cut) -> torch.Tensor:
    """The local tensor `target` of one full tensor from its stored pieces (checked by `check_cover`);
    padding rows are zero."""
    out = None
    full = stored[0][0].shape
    if any(piece.cut != Cut.whole(full, piece.cut.dim) for piece, _ in stored):
        target = target.along(stored[0][0].cut.dim, full)
    problem = Piece(stored[0][0].name, full, target).problem()
    if problem:
        raise ValueError(f"cannot cut {stored[0][0].name}: {problem}")
    by_cut: dict[Cut, list[tuple[Piece, Read]]] = {}
    for piece, read in stored:
        by_cut.setdefault(piece.cut.along(target.dim, full), []).append((piece, read))
    for cut, held in by_cut.items():
        overlaps = _overlaps(cut, target)
        if not overlaps:
            continue
        dim = cut.dim
        first, last = min(s for s, _, _ in overlaps), max(s + n for s, _, n in overlaps)
        if held[0][0].flat is None:
            source = held[0][1](dim, first, last)
        else:
            source = _local_rows(cut, held, first, last)
            first = first if dim == 0 else 0
        out = source.new_zeros(target.shape) if out is None else out
        for s, t, n in overlaps:
            out.narrow(dim, t, n).copy_(source.narrow(dim, s - first, n))
    if out is None:
        raise ValueError(f"no stored piece holds rows {target.rows}")
    return out
