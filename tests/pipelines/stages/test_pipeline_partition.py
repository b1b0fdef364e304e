"""Pipeline stages by cost: each layer weighs its forward FLOPs at the run's sequence length, so a hybrid's
stages even out its attention, MLP and Mamba layers and the head where counting layers does not; a
pattern's | marks set the stages. (That the engine builds these stages: test_pipeline_stages.py.)"""

import dataclasses
import itertools
import random

import pytest

from megamamba.config import MambaConfig
from megamamba.errors import LayoutError
from megamamba.pipelines.config.layout import Layout, check_run
from megamamba.pipelines.memory.plan import layer_parameters, stage_bounds
from megamamba.pipelines.stages.partition import balanced_cuts, cost_bounds, imbalance, stage_costs
from train_entry import ROOT

NEMOTRON = MambaConfig.from_json(str(ROOT / "launch/models/nemotron-h-8b.json"))


def _bounds(config, pp, method, seq):
    return [int(b) for b in stage_bounds(config, pp, method, layer_parameters(config, 1), 1, seq)]


@pytest.mark.parametrize("pp", [4, 8])
def test_cost_balances_a_hybrids_stages_better_than_counting_blocks(pp):
    """Nemotron-H-8B at seq 8192: the most expensive stage over the mean drops (pp 4: 1.21 -> 1.02)."""
    by_blocks, by_cost = _bounds(NEMOTRON, pp, "type:Block", 8192), _bounds(NEMOTRON, pp, "cost", 8192)
    assert by_cost != by_blocks
    blocks, cost = (imbalance(stage_costs(NEMOTRON, b, 8192)) for b in (by_blocks, by_cost))
    print(f"pp {pp}: type:Block {by_blocks} imbalance {blocks:.3f}, cost {by_cost} imbalance {cost:.3f}")
    assert cost < blocks and cost < 1.08, (blocks, cost)
    assert cost <= min(
        imbalance(stage_costs(NEMOTRON, _bounds(NEMOTRON, pp, m, 8192), 8192)) for m in ("uniform", "parameters")
    )


def test_attention_makes_the_stages_depend_on_the_sequence_length():
    """QK^T and AV grow with the sequence: at 64K tokens the attention-heavy first stage takes fewer blocks."""
    config = MambaConfig(
        d_model=64,
        n_layer=8,
        vocab_size=64,
        hybrid_layer_pattern="**MMMMMM",
        attn_cfg={"num_heads": 4, "head_dim": 16, "causal": True},
        ssm_cfg={"layer": "Mamba2"},
    )
    short, long = cost_bounds(config, 2, 128), cost_bounds(config, 2, 65536)
    assert short[1] > long[1] == 2, (short, long)  # embedding and the two attention blocks alone


def test_pure_mamba_stages_move_blocks_off_the_last_stage_for_the_head():
    """Counting blocks ignores the head (2 x d_model x vocab FLOPs a token, 9 Mamba-2 blocks' worth at 1.3b): by
    cost the last stage holds fewer blocks; mamba2-1.3b at pp 4: 13, 13, 13, 9 blocks instead of 12 each."""
    config = MambaConfig.from_json(str(ROOT / "launch/models/mamba2-1.3b.json"))
    by_cost = _bounds(config, 4, "cost", 2048)
    assert [b - a for a, b in zip(by_cost, by_cost[1:])] == [14, 13, 13, 11]  # embedding, norm, head: layers too
    assert imbalance(stage_costs(config, by_cost, 2048)) < imbalance(
        stage_costs(config, _bounds(config, 4, "type:Block", 2048), 2048)
    )


def test_the_heaviest_stage_is_minimal_then_the_rest_spread_evenly_lighter_first():
    assert balanced_cuts([1] * 23 + [11], 4) == [0, 7, 15, 23, 24]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced_cuts([1, 1, 1], 3) == [0, 1, 2, 3]  # as many stages as blocks
    assert balanced_cuts([1] * 5, 2) == [0, 2, 5] and balanced_cuts([2, 2, 2], 2) == [0, 1, 3]  # ties: lighter first


def test_balanced_cuts_equal_an_exhaustive_search():
    """Every cut of up to 8 weights (equal ones, one heavy one, fractions) into every number of runs: the heaviest
    run, then the sum of squared runs, as small as any cut's."""
    rng = random.Random(0)
    for trial in range(200):
        weights = [rng.choice([1, 1, 2, 3, 0.5, 40]) for _ in range(rng.randint(1, 8))]
        parts = rng.randint(1, len(weights))
        best = min(
            _score(weights, [0, *inner, len(weights)])
            for inner in itertools.combinations(range(1, len(weights)), parts - 1)
        )
        assert _score(weights, balanced_cuts(weights, parts)) == best, (trial, weights, parts)


def _score(weights, cuts):
    runs = [sum(weights[a:b]) for a, b in zip(cuts, cuts[1:])]
    return max(runs), sum(r * r for r in runs)


def test_more_runs_than_weights_is_refused():
    with pytest.raises(ValueError, match="3 runs of 2 weights: every run needs at least one"):
        balanced_cuts([1, 1], 3)


def test_pattern_marks_set_the_stages_whatever_the_method():
    config = dataclasses.replace(NEMOTRON, hybrid_layer_pattern="M-M-M-M*-M-M-M-M-M*-M-|M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
    for method in ("cost", "uniform", "type:Block"):
        assert _bounds(config, 2, method, 8192) == [0, 1 + 22, 55], method  # embedding first, norm and head last


def test_a_pattern_marking_another_number_of_stages_is_refused_before_the_run_starts():
    config = dataclasses.replace(NEMOTRON, hybrid_layer_pattern="M-M-M-M*-M-M-M-M-M*-M-|M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
    layout = Layout(world_size=4, dp=1, tp=1, pp=4, micro_batch_size=1, grad_accum=1)
    with pytest.raises(LayoutError, match=r"marks 2 pipeline stages with \|, but the pipeline parallel size is 4"):
        check_run(layout, {}, config, 8192, False, None)
