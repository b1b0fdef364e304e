"""The real PipelineModule at (tp, pp) = (2, 2): every stage's parameters, gathered over TP and named the
mamba_ssm way, together are exactly the single-device model's initial state dict; its stages are the
memory plan's `stage_bounds` (the default "cost" partition, a hybrid's | marks, DeepSpeed's "type:Block")."""

import pytest
import torch

from train_entry import ROOT

pytestmark = pytest.mark.slow

SEED = 5
SEQ = 48
HYBRID = {
    "hybrid_layer_pattern": "*M-",
    "d_intermediate": 96,
    "mlp_activation": "squared_relu",
    "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "head_dim": 16, "rotary_emb_dim": 8, "causal": True},
}
CASES = [  # model, tie_embeddings, partition method, model changes
    ("launch/models/tiny-mamba2.json", True, "cost", {}),
    ("launch/models/tiny-mamba1.json", False, "type:Block", {}),
    ("launch/models/tiny-mamba2.json", False, "cost", HYBRID),
    ("launch/models/tiny-mamba2.json", True, "cost", {**HYBRID, "hybrid_layer_pattern": "*|M-"}),
]


def _config(path, tied, changes):
    import dataclasses

    from megamamba import MambaConfig

    return dataclasses.replace(MambaConfig.from_json(path), n_layer=3, tie_embeddings=tied, **changes)


def _stage_states(cases):
    """Per case: (pipe rank, local parameter names, mamba_ssm-named full state of this rank's stage, stage bounds)."""
    from megamamba.parallel.groups import ParallelGroups, init_distributed
    from megamamba.pipelines.loop.engine import InitialState
    from megamamba.pipelines.stages.names import load_mamba_state_dict, mamba_state_dict
    from megamamba.pipelines.stages.pipeline_module import build_pipeline_module

    init_distributed()
    groups = ParallelGroups(tensor_parallel_size=2, pipeline_parallel_size=2)
    tp = groups.tensor_parallel()
    out = []
    for path, tied, method, changes in cases:
        config = _config(path, tied, changes)
        stage = build_pipeline_module(config, groups.topology, method, 0, tp, seq_length=SEQ)
        load_mamba_state_dict(stage, InitialState(config, SEED), config, tp)
        names = sorted(n for n, _ in stage.named_parameters())
        state = {k: v.detach().clone() for k, v in mamba_state_dict(stage, config, tp).items()}
        out.append((groups.pipe_rank, names, state, [int(b) for b in stage.partitions()]))
    return out


@pytest.fixture(scope="module")
def stage_states():
    from distributed import run_ranks

    cases = [(str(ROOT / path), *rest) for path, *rest in CASES]
    per_rank = run_ranks(_stage_states, 4, args=(cases,), init_process_group=False, timeout=240)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES))]


IDS = [f"{p.split('/')[-1]}-tied={t}-{m}{'-' + c['hybrid_layer_pattern'] if c else ''}" for p, t, m, c in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_stages_gathered_over_tp_give_back_the_full_mamba_ssm_state_dict(stage_states, case):
    from megamamba import MambaLM

    path, tied, _, changes = CASES[case]
    results = stage_states[case]
    config = _config(ROOT / path, tied, changes)
    torch.manual_seed(SEED)
    expected = MambaLM(config).state_dict()  # the single-device model: stages hold its weights bit for bit
    merged = {}
    for _, names, state, _ in results:
        assert all(n.split(".")[0].isdigit() or n.startswith("tied_modules.embed.") for n in names), names
        merged.update(state)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    first, last = [r for r in results if r[0] == 0], [r for r in results if r[0] == 1]
    assert "backbone.embedding.weight" in first[0][2] and "backbone.norm_f.weight" in last[0][2]
    assert ("lm_head.weight" in last[0][2]) and (tied == ("backbone.embedding.weight" in last[0][2]))


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_the_engines_stages_are_the_memory_plans(stage_states, case):
    from megamamba.pipelines.memory.plan import layer_parameters, stage_bounds

    path, tied, method, changes = CASES[case]
    config = _config(ROOT / path, tied, changes)
    planned = stage_bounds(config, 2, method, layer_parameters(config, 2), 2, SEQ)
    for pipe_rank, _, _, bounds in stage_states[case]:
        assert bounds == [int(b) for b in planned], (pipe_rank, bounds, planned)
    if "|" in changes.get("hybrid_layer_pattern", ""):
        assert planned == [0, 2, 6]  # embedding and the * block; M, -, the final norm and the head
