"""Context-parallel groups: consecutive ranks of DeepSpeed's data axis, which holds dp x cp ranks.

At 4 ranks, for (dp, cp, tp, pp) = (2, 2, 1, 1), (1, 2, 2, 1) and (1, 2, 1, 2): data-axis index i is
context rank i % cp of data-parallel replica i // cp; the context group is real (its members answer
over it), DeepSpeed's data group and the mpu's data-parallel size cover dp x cp ranks, and the
pipeline engine's grid sees the same data axis.
"""

import functools

import pytest

from distributed import group_members, run_ranks
from megamamba.parallel.groups import ParallelGroups

LAYOUTS = [(2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2)]  # (dp, cp, tp, pp) at 4 ranks
IDS = [f"dp{d}-cp{c}-tp{t}-pp{p}" for d, c, t, p in LAYOUTS]

pytestmark = pytest.mark.slow


def group_checks():
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from megamamba.parallel.groups import init_distributed

    init_distributed(dist_backend="gloo")
    out = {}
    for dp, cp, tp, pp in LAYOUTS:
        groups = ParallelGroups(tp, pp, dp, cp)
        context = groups.context_parallel()
        grid = PipelineParallelGrid(topology=groups.topology)
        mpu = groups.mpu() if pp == 1 else None
        out[dp, cp, tp, pp] = dict(
            replica=(groups.data_rank, groups.data_parallel_size),
            context=(context.rank, context.size, groups.context_ranks, group_members(context.group)),
            data_axis=(groups.data_axis_rank, groups.data_axis_size, group_members(groups.data_group)),
            grid=(grid.get_data_parallel_id(), grid.get_data_parallel_world_size()),
            mpu=None if mpu is None else (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        )
    without = ParallelGroups(2, 1).context_parallel()
    out["without_cp"] = (without.group, without.size, without.rank)
    out["refused"] = [_error(lambda: ParallelGroups(1, 1, 3, 2)), _error(lambda: ParallelGroups(1, 1, None, 3))]
    return out


def _error(build) -> str:
    try:
        build()
    except ValueError as e:
        return str(e)
    return "built"


@functools.cache
def _results():
    return run_ranks(group_checks, 4, timeout=300)


def _expected(dp, cp, tp, pp, rank):
    """Rank = (pipe * dp * cp + axis) * tp + model; axis = replica * cp + context."""
    axis_size = dp * cp
    pipe, axis, model = rank // (axis_size * tp), rank // tp % axis_size, rank % tp
    replica, context = divmod(axis, cp)
    context_ranks = [(pipe * axis_size + replica * cp + c) * tp + model for c in range(cp)]
    data_ranks = [(pipe * axis_size + a) * tp + model for a in range(axis_size)]
    return replica, context, axis, context_ranks, data_ranks


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_context_groups_are_consecutive_ranks_of_the_data_axis(layout):
    dp, cp, _, _ = layout
    for rank, res in enumerate(r[layout] for r in _results()):
        replica, context, _, context_ranks, _ = _expected(*layout, rank)
        assert res["replica"] == (replica, dp), f"rank {rank}"
        assert res["context"] == (context, cp, context_ranks, context_ranks), f"rank {rank}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_deepspeeds_data_axis_holds_data_times_context_ranks(layout):
    dp, cp, _, pp = layout
    for rank, res in enumerate(r[layout] for r in _results()):
        _, _, axis, _, data_ranks = _expected(*layout, rank)
        assert res["data_axis"] == (axis, dp * cp, data_ranks), f"rank {rank}"
        assert res["grid"] == (axis, dp * cp), f"rank {rank}"
        if pp == 1:
            assert res["mpu"] == (axis, dp * cp), f"rank {rank}"


def test_without_context_parallelism_no_group_is_created():
    assert all(r["without_cp"] == (None, 1, 0) for r in _results())


def test_a_layout_the_world_cannot_hold_is_refused_naming_every_size_and_the_product():
    assert all(
        r["refused"]
        == [
            "world size 4 != data (3) x context (2) x tensor (1) x pipeline (1) = 6",
            "world size 4 is not divisible by context (3) x tensor (1) x pipeline (1) = 3; "
            "data-parallel size = world / (context x tensor x pipeline)",
        ]
        for r in _results()
    ), _results()[0]["refused"]
