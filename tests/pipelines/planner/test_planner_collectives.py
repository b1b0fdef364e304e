"""The planner's collectives per layer are the ones our layers issue: for a whole model's forward, loss and
backward on 2 gloo ranks under bf16 autocast, the multiset of (kind, bytes) `comm_counter` records equals
the planner's, under TP with and without sequence parallelism (replicated B/C groups and key/value heads,
a gated norm spanning ranks, biases, MLPs inside blocks, Mamba-3 MIMO's whole angle columns and B/C norms) and
under CP (the worst rank: it sends its halo and receives one, so rank 0's forward and rank 1's backward)."""

import collections

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba import MambaConfig, MambaLM
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import layer_kinds
from megamamba.model.loss import lm_loss
from megamamba.parallel import TensorParallel, comm_counter
from megamamba.parallel.context.context_parallel import ContextParallel, sequence_slice
from megamamba.pipelines.planner.layer_costs import loss_work

BATCH, SEQLEN, SEED = 2, 32, 11
MAMBA2 = {"layer": "Mamba2", "d_state": 8, "headdim": 16, "chunk_size": 16}
CONFIGS = {
    "hybrid": MambaConfig(
        d_model=64,
        n_layer=3,
        vocab_size=37,
        pad_vocab_size_multiple=1,
        ssm_cfg=MAMBA2,
        hybrid_layer_pattern="M*-",
        d_intermediate=96,
        attn_cfg={"num_heads": 4, "num_heads_kv": 1, "causal": True, "rotary_emb_dim": 8},
    ),
    "mamba1_mlp_inside": MambaConfig(
        d_model=32,
        n_layer=2,
        vocab_size=37,
        pad_vocab_size_multiple=1,
        ssm_cfg={"layer": "Mamba1", "d_state": 4, "bias": True},
        d_intermediate=64,
        attn_layer_idx=[1],
        attn_cfg={"num_heads": 4, "num_heads_kv": 2, "causal": True},
    ),
    # MIMO rank 2 with one B/C group, replicated over TP; the per-head output norm; an MLP layer
    "mamba3_mimo": MambaConfig(
        d_model=32,
        n_layer=2,
        vocab_size=37,
        pad_vocab_size_multiple=1,
        ssm_cfg={
            "layer": "Mamba3",
            "d_state": 8,
            "headdim": 8,
            "chunk_size": 4,
            "is_mimo": True,
            "mimo_rank": 2,
            "is_outproj_norm": True,
        },
        hybrid_layer_pattern="M-",
        d_intermediate=48,
    ),
}
CASES = [(name, tp, cp, sp) for name in CONFIGS for tp, cp, sp in ((2, 1, True), (2, 1, False), (1, 2, False))]


def counted(name, tp_size, cp_size, sequence_parallel):
    """(forward, backward) collectives of one model step on this rank, as (kind, nbytes)."""
    config, rank = CONFIGS[name], dist.get_rank()
    tp = TensorParallel(dist.group.WORLD, tp_size, rank, sequence_parallel) if tp_size > 1 else None
    cp = ContextParallel(dist.group.WORLD, cp_size, rank) if cp_size > 1 else None
    torch.manual_seed(SEED)
    model = MambaLM(config, tp=tp, cp=cp)
    gen = torch.Generator().manual_seed(SEED)
    ids, labels = (torch.randint(0, config.vocab_size, (BATCH, SEQLEN), generator=gen) for _ in range(2))
    if cp is not None:
        ids, labels = sequence_slice(ids, cp), sequence_slice(labels, cp)
    with torch.autocast("cpu", dtype=torch.bfloat16), comm_counter.capture() as forward:
        loss = lm_loss(model(ids), labels, config.vocab_size, tp, cp)
    with comm_counter.capture() as backward:
        loss.backward()
    return [(r.kind.replace("_max", ""), r.nbytes) for r in forward], [(r.kind, r.nbytes) for r in backward]


def all_cases():
    return {case: counted(*case) for case in CASES}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(all_cases, 2, timeout=300)


def predicted(name, tp, cp, sequence_parallel):
    shape = RankShape(CONFIGS[name], BATCH, SEQLEN, tp, cp, sequence_parallel, act=2)
    out = {False: collections.Counter(), True: collections.Counter()}
    works = [layer_type(kind).work(shape) for kind in layer_kinds(CONFIGS[name])] + [loss_work(shape)]
    for work in works:
        for c in work.collectives:
            out[c.backward][(c.kind, int(c.nbytes))] += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{n}-tp{t}-cp{c}{'-sp' if s else ''}" for n, t, c, s in CASES])
def test_the_planners_collectives_are_the_ones_counted(ranks, case):
    forward = collections.Counter(ranks[0][case][0])
    backward = collections.Counter(ranks[-1][case][1])
    expected = predicted(*case)
    assert (forward, backward) == (expected[False], expected[True]), case
