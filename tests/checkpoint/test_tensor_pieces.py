"""Pieces of full tensors: a rank's TP rows and ZeRO fragments are put back into any other layout's cut, exactly."""

import math

import pytest
import torch

from megamamba.checkpoint.tensor_pieces import Cut, Piece, assemble, check_cover
from megamamba.parallel.tensor.sharding import Component, Shard, local_shard

SHAPES = {  # full shape, shard
    "rows": ((12, 5), Shard("w", 0, (Component("rows", 12),))),
    "padded vocab": ((11, 3), Shard("w", 0, (Component("vocab", 11),), pad=1)),
    "columns": ((3, 12), Shard("w", 1, (Component("cols", 12),))),
    "components": ((26, 3), Shard("w", 0, (Component("z", 12), Component("x", 12), Component("B", 2, sharded=False)))),
}
REPLICATED = {"components": Shard("w", 0, SHAPES["components"][1].components, replicated_part=True, grad_reduced=True)}


def _shard_at(shard: Shard, tp_size: int) -> Shard:
    if shard.pad:
        return Shard(shard.full_name, shard.dim, shard.components, pad=-shard.components[0].size % tp_size)
    return shard


def _cuts(case: str, tp_size: int) -> list:
    """Every (shard, cut) of the layout with `tp_size` ranks (the replicated part once)."""
    shape, shard = SHAPES[case]
    shard = _shard_at(shard, tp_size)
    out = []
    for rank in range(tp_size):
        local = local_shard(torch.empty(shape), shard, tp_size, rank).shape
        out.append((shard, rank, Cut(shard.dim, tuple(shard.full_rows(tp_size, rank)), tuple(local))))
    if case in REPLICATED:
        replicated = REPLICATED[case]
        local = local_shard(torch.empty(shape), replicated, tp_size, 0).shape
        out.append((replicated, 0, Cut(0, tuple(replicated.full_rows(tp_size, 0)), tuple(local))))
    return out


def _stored(full: torch.Tensor, case: str, tp_size: int, dp_size: int, seed: int) -> list:
    """(piece, read) of every rank's local tensor, split into `dp_size` flat fragments at random boundaries."""
    generator = torch.Generator().manual_seed(seed)
    stored = []
    for shard, rank, cut in _cuts(case, tp_size):
        local = local_shard(full, shard, tp_size, rank)
        bounds = sorted(torch.randperm(local.numel() - 1, generator=generator)[: dp_size - 1].add(1).tolist())
        for start, stop in zip([0] + bounds, bounds + [local.numel()]):
            flat = (start, stop) if dp_size > 1 else None
            value = local.reshape(-1)[start:stop].clone() if flat else local.clone()
            stored.append(
                (Piece("w", tuple(full.shape), cut, flat), lambda d, a, b, value=value: value.narrow(d, a, b - a))
            )
    return stored


def _divides(case: str, tp_size: int) -> bool:
    _, shard = SHAPES[case]
    return bool(shard.pad) or all(c.size % tp_size == 0 for c in shard.components if c.sharded)


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_full_rows_are_the_rows_local_shard_cuts(case, tp_size):
    if not _divides(case, tp_size):
        pytest.skip("layout does not divide")
    full = torch.randn(SHAPES[case][0], generator=torch.Generator().manual_seed(tp_size))
    for shard, rank, cut in _cuts(case, tp_size):
        local = local_shard(full, shard, tp_size, rank)
        rows = [full.narrow(cut.dim, a, b - a) for a, b in cut.rows]
        held = sum(b - a for a, b in cut.rows)
        assert torch.equal(local.narrow(cut.dim, 0, held), torch.cat(rows, cut.dim)), (shard, rank)
        assert not local.narrow(cut.dim, held, local.shape[cut.dim] - held).any()


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize(
    ("source", "target"), [((2, 3), (1, 1)), ((1, 4), (2, 1)), ((3, 2), (2, 2)), ((2, 1), (4, 3)), ((1, 1), (3, 1))]
)
def test_any_layouts_pieces_assemble_any_other_layouts_cut_bit_for_bit(case, source, target):
    (tp_src, dp_src), (tp_dst, _) = source, target
    if not (_divides(case, tp_src) and _divides(case, tp_dst)):
        pytest.skip("layout does not divide")
    seed = 17 * tp_src + dp_src
    full = torch.randn(SHAPES[case][0], generator=torch.Generator().manual_seed(seed))
    stored = _stored(full, case, tp_src, dp_src, seed)
    check_cover("w", [piece for piece, _ in stored])
    for shard, rank, cut in _cuts(case, tp_dst):
        assert torch.equal(assemble(stored, cut), local_shard(full, shard, tp_dst, rank)), (seed, shard, rank)
    assert torch.equal(assemble(stored, Cut.whole(full.shape)), full), seed


def test_a_missing_fragment_or_a_piece_stored_twice_is_refused():
    full = torch.randn(SHAPES["rows"][0], generator=torch.Generator().manual_seed(3))
    pieces = [piece for piece, _ in _stored(full, "rows", 2, 3, 3)]
    with pytest.raises(ValueError, match="do not tile"):
        check_cover("w", pieces[1:])
    first_rank = Piece("w", pieces[0].shape, pieces[0].cut)
    with pytest.raises(ValueError, match=r"rows \[\(0, 6\)\] along dim 0 do not cover 0..12"):
        check_cover("w", [first_rank])
    with pytest.raises(ValueError, match="stored 2 times"):
        check_cover("w", [first_rank, first_rank])


def test_a_cut_along_dim_0_reads_only_its_rows_of_each_fragment():
    full = torch.randn(SHAPES["rows"][0], generator=torch.Generator().manual_seed(5))
    read_elements = []

    def counted(piece, read):
        def count(d, a, b):
            part = read(d, a, b)
            read_elements.append(part.numel())
            return part

        return piece, count

    stored = [counted(*entry) for entry in _stored(full, "rows", 1, 4, 5)]
    assert torch.equal(assemble(stored, Cut(0, ((4, 9),), (5, 5))), full[4:9])
    assert sum(read_elements) == 5 * math.prod(full.shape[1:])
