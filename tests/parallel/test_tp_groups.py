"""Process groups: laid out as DeepSpeed's topology and grid, impossible layouts refused."""

import functools

import pytest

from distributed import group_members, run_ranks
from megamamba.parallel.groups import ParallelGroups, data_parallel_size_for

LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (1, 2, 2), (2, 1, 2)]  # (dp, tp, pp) at 4 ranks


def _describe(groups):
    return dict(
        coords=(groups.data_rank, groups.tensor_rank, groups.pipe_rank),
        ranks=(groups.data_ranks, groups.tensor_ranks, groups.pipe_ranks),
        members=tuple(group_members(g) for g in (groups.data_group, groups.tensor_group, groups.pipe_group)),
    )


def _describe_grid(grid):
    """What DeepSpeed's pipeline engine sees from the same topology."""
    return dict(
        coords=(grid.get_data_parallel_id(), grid.get_slice_parallel_rank(), grid.get_stage_id()),
        ranks=(grid.dp_group, grid.slice_group, grid.pp_group),
    )


def _describe_mpu(mpu):
    return dict(
        model=(
            mpu.get_model_parallel_rank(),
            mpu.get_model_parallel_world_size(),
            group_members(mpu.get_model_parallel_group()),
        ),
        tensor=(
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
            group_members(mpu.get_tensor_model_parallel_group()),
            mpu.get_tensor_model_parallel_src_rank(),
        ),
        data=(
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            group_members(mpu.get_data_parallel_group()),
            mpu.get_data_parallel_group_ranks(),
        ),
        pipe=(
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_world_size(),
            group_members(mpu.get_pipe_parallel_group()),
        ),
    )


def _error(build):
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return None


def group_checks():
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from megamamba.parallel.groups import init_distributed

    init_distributed(dist_backend="gloo")
    out = {}
    for dp, tp, pp in LAYOUTS:
        groups = ParallelGroups(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        out[dp, tp, pp] = dict(
            ours=_describe(groups),
            grid=_describe_grid(PipelineParallelGrid(topology=groups.topology)),
            mpu=_describe_mpu(groups.mpu()) if pp == 1 else _error(groups.mpu),
            tensor_parallel=(
                groups.tensor_parallel(sequence_parallel=True).size,
                groups.tensor_parallel(sequence_parallel=True).rank,
            ),
        )
    out["bad_tp"] = _error(lambda: ParallelGroups(tensor_parallel_size=3))
    out["bad_total"] = _error(
        lambda: ParallelGroups(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    )
    return out


@functools.cache
def _results():
    return run_ranks(group_checks, 4, timeout=300)


def _expected(dp, tp, pp, rank):
    """Rank r = (pipe * dp + data) * tp + model: DeepSpeed's axes ['pipe', 'data', 'model']."""
    pipe, data, model = rank // (dp * tp), rank // tp % dp, rank % tp
    tensor_ranks = [(pipe * dp + data) * tp + m for m in range(tp)]
    data_ranks = [(pipe * dp + d) * tp + model for d in range(dp)]
    pipe_ranks = [(p * dp + data) * tp + model for p in range(pp)]
    return (data, model, pipe), (data_ranks, tensor_ranks, pipe_ranks)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{d}-tp{t}-pp{p}" for d, t, p in LAYOUTS])
def test_groups_follow_deepspeeds_topology_with_the_tensor_rank_fastest(layout):
    for rank, res in enumerate(r[layout]["ours"] for r in _results()):
        coords, ranks = _expected(*layout, rank)
        assert res["coords"] == coords and res["ranks"] == ranks and res["members"] == ranks, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{d}-tp{t}-pp{p}" for d, t, p in LAYOUTS])
def test_groups_agree_with_the_pipeline_engines_grid(layout):
    for rank, res in enumerate(_results()):
        assert res[layout]["ours"]["coords"] == res[layout]["grid"]["coords"], f"rank {rank}"
        assert res[layout]["ours"]["ranks"] == res[layout]["grid"]["ranks"], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(4, 1, 1), (1, 4, 1), (2, 2, 1)], ids=["dp4", "tp4", "dp2-tp2"])
def test_mpu_model_parallel_means_tensor_parallel(layout):
    dp, tp, _ = layout
    for rank, res in enumerate(r[layout]["mpu"] for r in _results()):
        (data, model, _), (data_ranks, tensor_ranks, _) = _expected(*layout, rank)
        assert res["model"] == (model, tp, tensor_ranks)
        assert res["tensor"] == (model, tp, tensor_ranks, tensor_ranks[0])
        assert res["data"] == (data, dp, data_ranks, data_ranks)
        assert res["pipe"] == (0, 1, [rank])


@pytest.mark.slow
def test_mpu_is_refused_with_pipeline_parallelism():
    assert "pipeline size 2: pass mpu=None with a PipelineModule" in _results()[0][1, 2, 2]["mpu"]


@pytest.mark.slow
def test_tensor_parallel_handle_carries_the_tensor_rank_and_size():
    assert [r[2, 2, 1]["tensor_parallel"] for r in _results()] == [(2, 0), (2, 1), (2, 0), (2, 1)]


@pytest.mark.slow
def test_building_groups_for_an_impossible_layout_is_refused_on_every_rank():
    for res in _results():
        assert res["bad_tp"] == (
            "world size 4 is not divisible by context (1) x tensor (3) x pipeline (1) = 3; "
            "data-parallel size = world / (context x tensor x pipeline)"
        )
        assert res["bad_total"] == "world size 4 != data (2) x context (1) x tensor (2) x pipeline (2) = 8"


def test_data_parallel_size_is_world_over_tensor_times_pipeline():
    assert data_parallel_size_for(8, 2, 2) == 2
    assert data_parallel_size_for(8, 2, 2, data_parallel_size=2) == 2
    assert data_parallel_size_for(1) == 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(world_size=6, tensor_parallel_size=4),
            r"world size 6 is not divisible by context \(1\) x tensor \(4\) x pipeline \(1\) = 4",
        ),
        (
            dict(world_size=8, tensor_parallel_size=2, data_parallel_size=2),
            r"world size 8 != data \(2\) x context \(1\) x tensor \(2\) x pipeline \(1\) = 4",
        ),
        (
            dict(world_size=4, data_parallel_size=3, context_parallel_size=2),
            r"world size 4 != data \(3\) x context \(2\) x tensor \(1\) x pipeline \(1\) = 6",
        ),
        (dict(world_size=8, tensor_parallel_size=0), r"tensor_parallel_size must be a positive integer, got 0"),
        (dict(world_size=8, context_parallel_size=0), r"context_parallel_size must be a positive integer, got 0"),
        (dict(world_size=8, pipeline_parallel_size=-2), r"pipeline_parallel_size must be a positive integer, got -2"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data_parallel_size_for(**kwargs)
