"""The autograd regions at TP 2: what each does forward and backward, and what it counts.

Each rank draws its own input and upstream gradient from (seed, rank), so every rank can
recompute every other rank's tensors and the expected sums in float64.
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba.parallel import (
    CommRecord,
    TensorParallel,
    comm_counter,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    start_sequence_gather,
)
from megamamba.testing.numerics import relative_error

SEED = 99
SHAPE = (3, 4, 6)  # batch, seqlen, hidden
WORLD = 2


def _draw(tag, rank, shape=SHAPE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED + 1000 * tag + rank), dtype=torch.float64)


def _apply(region, x, upstream, tp):
    """Run `region` forward and backward; output, input gradient, collectives of each phase."""
    x = x.clone().requires_grad_()
    before = x.detach().clone()
    with comm_counter.capture() as fwd:
        y = region(x, tp)
    with comm_counter.capture() as bwd:
        y.backward(upstream)
    return dict(y=y.detach(), grad=x.grad, fwd=fwd, bwd=bwd, input_kept=torch.equal(x.detach(), before))


def _gather_seq_with_overlap(x, tp):
    pending = start_sequence_gather(x, tp)
    torch.randn(64, 64).matmul(torch.randn(64, 64))  # work while the gather travels
    return pending.wait()


def _async_start_timing(tp):
    """Rank 1 joins late: rank 0's start must return at once and only its wait() block."""
    if tp.rank == 1:
        time.sleep(1.5)
    begin = time.monotonic()
    pending = start_sequence_gather(_draw(0, tp.rank), tp)
    started = time.monotonic() - begin
    pending.wait()
    return started, time.monotonic() - begin


def region_checks():
    rank = dist.get_rank()
    tp = TensorParallel(dist.group.WORLD, WORLD, rank)
    mine, shared = _draw(0, rank), _draw(1, 0)
    up_mine = _draw(2, rank)
    seq_up = _draw(2, rank, (3, 8, 6))
    out = {
        "copy": _apply(copy_to_tp_region, mine, up_mine, tp),
        "reduce": _apply(reduce_from_tp_region, mine, up_mine, tp),
        "gather_last": _apply(gather_from_tp_region, mine, _draw(3, 0, (3, 4, 12)), tp),
        "scatter_last": _apply(scatter_to_tp_region, shared, up_mine[..., :3], tp),
        "gather_seq": _apply(gather_from_sequence_region, mine, seq_up, tp),
        "gather_seq_async": _apply(_gather_seq_with_overlap, mine, seq_up, tp),
        "reduce_scatter_seq": _apply(reduce_scatter_to_sequence_region, mine, up_mine[:, :2], tp),
        "scatter_seq": _apply(scatter_to_sequence_region, shared, up_mine[:, :2], tp),
    }
    out["async_timing"] = _async_start_timing(tp)
    try:
        reduce_scatter_to_sequence_region(torch.zeros(3, 5, 6), tp)
    except ValueError as exc:
        out["indivisible"] = str(exc)
    return out


@functools.cache
def _results():
    return run_ranks(region_checks, WORLD, timeout=180)


def _each(name):
    return list(enumerate(r[name] for r in _results()))


def _all(tag, shape=SHAPE):
    return [_draw(tag, r, shape) for r in range(WORLD)]


def _counted(res, fwd, bwd):
    return res["fwd"] == [CommRecord(k, n, WORLD) for k, n in fwd] and res["bwd"] == [
        CommRecord(k, n, WORLD) for k, n in bwd
    ]


BYTES = 3 * 4 * 6 * 8  # one rank's SHAPE in float64


@pytest.mark.slow
def test_copy_to_tp_region_is_identity_forward_and_sums_gradients_backward():
    for rank, res in _each("copy"):
        assert torch.equal(res["y"], _draw(0, rank))
        assert relative_error(res["grad"], sum(_all(2))) <= 1e-12
        assert _counted(res, [], [("all_reduce", BYTES)])


@pytest.mark.slow
def test_reduce_from_tp_region_sums_forward_and_passes_gradients_backward():
    for rank, res in _each("reduce"):
        assert relative_error(res["y"], sum(_all(0))) <= 1e-12
        assert torch.equal(res["grad"], _draw(2, rank))
        assert res["input_kept"]
        assert _counted(res, [("all_reduce", BYTES)], [])


@pytest.mark.slow
def test_gather_from_tp_region_concatenates_last_dim_and_keeps_own_gradient_slice():
    for rank, res in _each("gather_last"):
        assert torch.equal(res["y"], torch.cat(_all(0), -1))
        assert torch.equal(res["grad"], _draw(3, 0, (3, 4, 12)).chunk(WORLD, -1)[rank])
        assert _counted(res, [("all_gather", 2 * BYTES)], [])


@pytest.mark.slow
def test_scatter_to_tp_region_keeps_own_slice_and_gathers_gradients():
    for rank, res in _each("scatter_last"):
        assert torch.equal(res["y"], _draw(1, 0).chunk(WORLD, -1)[rank])
        assert torch.equal(res["grad"], torch.cat([g[..., :3] for g in _all(2)], -1))
        assert _counted(res, [], [("all_gather", BYTES)])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gather_seq", "gather_seq_async"])
def test_sequence_gather_concatenates_sequence_and_reduce_scatters_gradients(name):
    for rank, res in _each(name):
        assert torch.equal(res["y"], torch.cat(_all(0), 1))
        assert relative_error(res["grad"], sum(_all(2, (3, 8, 6))).chunk(WORLD, 1)[rank]) <= 1e-12
        assert _counted(res, [("all_gather", 2 * BYTES)], [("reduce_scatter", 2 * BYTES)])


@pytest.mark.slow
def test_sequence_reduce_scatter_sums_then_keeps_own_shard_and_gathers_gradients():
    for rank, res in _each("reduce_scatter_seq"):
        assert relative_error(res["y"], sum(_all(0)).chunk(WORLD, 1)[rank]) <= 1e-12
        assert torch.equal(res["grad"], torch.cat([g[:, :2] for g in _all(2)], 1))
        assert res["input_kept"]
        assert _counted(res, [("reduce_scatter", BYTES)], [("all_gather", BYTES)])


@pytest.mark.slow
def test_sequence_scatter_keeps_own_shard_and_gathers_gradients():
    for rank, res in _each("scatter_seq"):
        assert torch.equal(res["y"], _draw(1, 0).chunk(WORLD, 1)[rank])
        assert torch.equal(res["grad"], torch.cat([g[:, :2] for g in _all(2)], 1))
        assert _counted(res, [], [("all_gather", BYTES)])


@pytest.mark.slow
def test_sequence_gather_starts_without_waiting_for_the_other_ranks():
    started, finished = _results()[0]["async_timing"]
    assert started < 0.5 and finished > 1.0, f"start took {started:.2f} s, start + wait {finished:.2f} s"


@pytest.mark.slow
def test_indivisible_sequence_is_refused_naming_the_numbers():
    for _, message in _each("indivisible"):
        assert "seqlen = 5 divisible by the TP size 2" in message


def test_regions_are_identities_at_tp1_and_count_nothing():
    tp = TensorParallel()
    x = torch.randn(3, 4, 6)
    regions = [
        copy_to_tp_region,
        reduce_from_tp_region,
        gather_from_tp_region,
        scatter_to_tp_region,
        gather_from_sequence_region,
        reduce_scatter_to_sequence_region,
        scatter_to_sequence_region,
    ]
    with comm_counter.capture() as records:
        outs = [region(x, tp) for region in regions] + [start_sequence_gather(x, tp).wait()]
    assert all(out is x for out in outs) and records == []
