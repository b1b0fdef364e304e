"""The planner's cost model: its FLOPs are the training log's, collectives follow the ring's alpha-beta
law, the pipeline bubble is DeepSpeed 1F1B's (p - 1) / (m + p - 1), the data-parallel traffic is
DeepSpeed 0.19.8's per ZeRO stage, a measured profile's layer fits and engine costs apply where they
are measured, and profiles are read strictly."""

import dataclasses
import json
import os

import pytest

from megamamba import MambaConfig
from megamamba.model.flops import layer_flops
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.attention import causal_pairs
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import layer_kinds
from megamamba.pipelines.planner.profile import EngineCost, Kernel, LayerFit, Link, ProfileError, load_profile
from megamamba.pipelines.planner.search import Request, search
from megamamba.pipelines.planner.step_time import (
    Grid,
    StageTime,
    collective_seconds,
    data_parallel_seconds,
    kernel_seconds,
    kernel_seconds_of,
    layer_time,
)
from train_entry import ROOT

H100 = load_profile(os.path.join(ROOT, "launch/profiles/h100-80gb.json"))
HYBRID = MambaConfig(
    d_model=96,
    n_layer=4,
    vocab_size=257,
    hybrid_layer_pattern="M*-M",
    d_intermediate=192,
    attn_cfg={"num_heads": 6, "num_heads_kv": 2, "causal": True, "rotary_emb_dim": 8},
    ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16, "chunk_size": 64},
)
MAMBA1 = MambaConfig(d_model=96, n_layer=2, vocab_size=257, ssm_cfg={"d_state": 8})
MAMBA3_MIMO = MambaConfig(
    d_model=96,
    n_layer=2,
    vocab_size=257,
    ssm_cfg={"layer": "Mamba3", "d_state": 16, "headdim": 16, "chunk_size": 16, "is_mimo": True, "mimo_rank": 2},
)


@pytest.mark.parametrize("config", [HYBRID, MAMBA1, MAMBA3_MIMO], ids=["hybrid", "mamba1", "mamba3-mimo"])
def test_a_layers_kernel_flops_are_the_training_logs_flops(config):
    seq = 256
    shape = RankShape(config, micro_batch_size=2, seq_length=seq)
    tokens = 2 * seq
    for kind, per_token in zip(layer_kinds(config), layer_flops(config, seq)):
        counted = sum(k.flops for k in layer_type(kind).work(shape).kernels)
        if kind == "attention":  # exactly s(s+1)/2 pairs, not s/2 keys a token: the last s/2 pairs apart
            per_token += 2 * 2 * 6 * 16 // 2
        assert counted == pytest.approx(per_token * tokens, rel=1e-12), kind


def test_the_last_context_parallel_rank_attends_the_most_pairs():
    shape = RankShape(HYBRID, 1, 1024, cp=4)
    width = 256
    assert causal_pairs(shape) == 3 * width * width + width * (width + 1) // 2
    assert causal_pairs(RankShape(HYBRID, 1, 1024)) == 1024 * 1025 // 2


def test_a_ring_collective_costs_alpha_per_step_and_its_share_of_the_bytes():
    link = Link(alpha_s=1e-5, bytes_per_s=1e9)
    assert collective_seconds("all_reduce", 8e6, 4, link) == pytest.approx(2 * (3 * 1e-5 + 3 / 4 * 8e6 / 1e9))
    assert collective_seconds("all_gather", 8e6, 4, link) == pytest.approx(3 * 1e-5 + 3 / 4 * 8e6 / 1e9)
    assert collective_seconds("all_reduce", 8e6, 1, link) == 0


def test_the_pipeline_bubble_is_p_minus_1_slots_of_the_slowest_stage():
    result = search(
        Request(HYBRID, 4, 4, 256, 16, 16 * 2**30, fixed={"pp": 4, "tp": 1, "cp": 1, "micro_batch_size": 1}), H100
    )
    plan = result.plans[0]
    stage = plan.time.compute + plan.time.tp_comm + plan.time.cp_comm + plan.time.pipeline_sends
    m, p = plan.grad_accum, plan.pp
    assert plan.time.bubble / (stage + plan.time.bubble) == pytest.approx((p - 1) / (m + p - 1))


def test_a_profile_missing_a_link_is_refused_by_name(tmp_path):
    data = json.loads(open(os.path.join(ROOT, "launch/profiles/h100-80gb.json")).read())
    del data["links"]["inter_node"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="links.inter_node is missing"):
        load_profile(str(tmp_path / "p.json"))


GRID = Grid(dp=4, cp=1, tp=1, pp=1, gpus_per_node=8)
LINK = H100.links["intra_node"]
REDUCE, GATHER = (collective_seconds(kind, 4e8, 4, LINK) for kind in ("all_reduce", "all_gather"))


@pytest.mark.parametrize("zero, expected", [(0, REDUCE), (1, REDUCE + GATHER), (2, 3 * REDUCE + GATHER)])
def test_zero_0_to_2_expose_their_all_reduces_and_parameter_all_gather(zero, expected):
    """DeepSpeed 0.19.8: ZeRO 1/2 all-reduce the gradient buckets (use_multi_rank_bucket_allreduce) and
    all-gather the parameters after the step; ZeRO 2 reduces in each of the 3 micro-batches' backward."""
    stage = StageTime(compute=30.0, tp_comm=0, cp_comm=0, sends=0, forward=10.0)
    assert data_parallel_seconds(4e8, zero, GRID, H100, 3, stage) == pytest.approx(expected)


def test_zero_3_exposes_only_the_traffic_its_compute_does_not_cover():
    scatter = collective_seconds("reduce_scatter", 4e8, 4, LINK)
    idle = StageTime(compute=0.0, tp_comm=0, cp_comm=0, sends=0, forward=0.0)
    busy = StageTime(compute=30.0, tp_comm=0, cp_comm=0, sends=0, forward=10.0)
    assert data_parallel_seconds(4e8, 3, GRID, H100, 3, idle) == pytest.approx(3 * (2 * GATHER + scatter))
    assert data_parallel_seconds(4e8, 3, GRID, H100, 3, busy) == 0


def test_zero_3_pays_a_ring_latency_for_each_layer_it_gathers():
    idle = StageTime(compute=0.0, tp_comm=0, cp_comm=0, sends=0, forward=0.0)
    one, ten = (data_parallel_seconds(4e8, 3, GRID, H100, 1, idle, layers) for layers in (1, 10))
    assert ten - one == pytest.approx(2 * 9 * 3 * LINK.alpha_s)


@pytest.mark.parametrize(
    "bandwidth, overlap", [(1e9, True), (1e13, True), (1e13, False)], ids=["slow-link", "fast-link", "no-overlap"]
)
def test_an_input_projections_collectives_cost_what_outlasts_the_matmul_beside_them(bandwidth, overlap):
    """Under sequence parallelism the all-gather runs beside the product of this rank's own tokens (1/TP of
    the matmul), the input gradient's reduce-scatter beside the weight gradient's product; on a profile
    without overlap (the CPU) nothing is hidden."""
    profile = dataclasses.replace(
        H100, links={"intra_node": Link(1e-6, bandwidth), "inter_node": Link(1e-6, 1e9)}, overlap=overlap
    )
    shape = RankShape(MAMBA1, micro_batch_size=2, seq_length=4096, tp=2, sequence_parallel=True)
    work = layer_type("head").work(shape)
    projection = work.kernels[0]
    matmul = kernel_seconds(projection.kind, projection.flops, projection.bytes, profile)
    comm = collective_seconds("all_gather", shape.tokens * 96 * 2, 2, profile.links["intra_node"])
    tp_only = dataclasses.replace(work, collectives=work.collectives[:2])
    grid = Grid(dp=1, cp=1, tp=2, pp=1, gpus_per_node=8)
    expected = max(0.0, comm - matmul / 2) + max(0.0, comm - matmul) if overlap else 2 * comm
    assert layer_time("head", tp_only, grid, profile, recompute=False).tp_comm == pytest.approx(expected)


def test_context_parallel_mamba2_adds_its_float32_state_product_recomputed_in_the_backward():
    shape = RankShape(HYBRID, micro_batch_size=2, seq_length=256, cp=2)
    extra = [k for k in layer_type("mamba").work(shape).kernels if k.kind == "matmul_fp32"]
    assert [(k.flops, k.checkpointed) for k in extra] == [(2 * shape.tokens * HYBRID.d_inner * 16, True)]
    assert not [k for k in layer_type("mamba").work(RankShape(HYBRID, 2, 256)).kernels if k.kind == "matmul_fp32"]


def test_a_written_profile_reads_back_equal(tmp_path):
    kernels = {"ssd": Kernel(efficiency=0.35, backward_ratio=1.3, fixed_s=6e-4), "norm": Kernel(0.5, 2.0)}
    profile = dataclasses.replace(
        H100,
        kernels=kernels,
        layers={"mamba": LayerFit(1e-4, 1.2, 2e-4, 0.9)},
        engine={"0": EngineCost(3e-3, 1e-2), "2": EngineCost(4e-3, 2e-2)},
    )
    profile.to_json(str(tmp_path / "p.json"))
    assert load_profile(str(tmp_path / "p.json")) == profile


def test_without_overlap_zero_3_exposes_all_its_traffic():
    busy = StageTime(compute=30.0, tp_comm=0, cp_comm=0, sends=0, forward=10.0)
    serial = dataclasses.replace(H100, overlap=False)
    scatter = collective_seconds("reduce_scatter", 4e8, 4, LINK)
    assert data_parallel_seconds(4e8, 3, GRID, serial, 3, busy) == pytest.approx(3 * (2 * GATHER + scatter))


def test_the_shipped_cpu_profile_is_a_measured_one_and_loads():
    profile = load_profile(os.path.join(ROOT, "launch/profiles/cpu.json"))
    assert profile.source.startswith("measured")
    assert set(profile.layers) == {"embedding", "mamba", "attention", "mlp", "final_norm", "head", "loss"}
    assert set(profile.engine) == {"0", "1", "2"} and set(profile.collective_call_s) == {"tp", "cp"}


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_a_layer_fit_turns_its_kernels_time_into_the_layers_measured_time(recompute):
    """forward = fixed + scale x the kernels' forward (twice under recomputation), backward likewise."""
    fitted = dataclasses.replace(H100, layers={"mamba": LayerFit(1e-3, 2.0, 3e-3, 0.5)})
    work = layer_type("mamba").work(RankShape(HYBRID, 2, 256))
    forward, backward = kernel_seconds_of(work, fitted)
    one = Grid(1, 1, 1, 1, 1)
    time = layer_time("mamba", work, one, fitted, recompute)
    assert time.forward == pytest.approx(1e-3 + 2 * forward)
    assert time.compute == pytest.approx((1 + recompute) * (1e-3 + 2 * forward) + 3e-3 + 0.5 * backward)
    unfitted = layer_time("mlp", work, one, fitted, recompute)
    assert unfitted.compute == pytest.approx((1 + recompute) * forward + backward)


def test_the_engine_costs_its_share_per_micro_batch_and_once_per_step():
    measured = dataclasses.replace(H100, engine={"1": EngineCost(micro_batch_s=0.01, step_s=0.1)})
    request = Request(HYBRID, 1, 1, 256, 4, 16 * 2**30, fixed={"micro_batch_size": 1, "zero_stage": 1})
    plan = search(request, measured).plans[0]
    assert plan.grad_accum == 4 and plan.time.overhead == pytest.approx(4 * 0.01 + 0.1)
    assert search(request, H100).plans[0].time.overhead == 0


def test_the_layers_run_at_the_models_scale_and_at_the_shared_nodes_only_beside_other_ranks():
    scaled = dataclasses.replace(H100, model_scale=1.25, shared_node_scale=1.5)
    work = layer_type("mlp").work(RankShape(HYBRID, 2, 256))
    alone, beside = (
        layer_time("mlp", work, grid, scaled, False).compute for grid in (Grid(1, 1, 1, 1, 8), Grid(2, 1, 1, 1, 8))
    )
    forward, backward = kernel_seconds_of(work, scaled)
    assert alone == pytest.approx(1.25 * (forward + backward)) and beside == pytest.approx(1.5 * alone)
    assert layer_time("mlp", work, Grid(2, 1, 1, 1, 1), scaled, False).compute == pytest.approx(alone)
