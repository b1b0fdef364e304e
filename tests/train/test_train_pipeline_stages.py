"""The real PipelineModule at (tp, pp) = (2, 2): every stage's parameters, gathered over TP and named the
mamba_ssm way, together are exactly the single-device model's initial state dict."""
import pytest
import torch

from distributed import run_ranks
from train_entry import ROOT

pytestmark = pytest.mark.slow

SEED = 5
CASES = [("launch/models/tiny-mamba2.json", True), ("launch/models/tiny-mamba1.json", False)]


def _stage_states(cases):
    """Per case: (pipe rank, local parameter names, mamba_ssm-named full state of this rank's stage)."""
    import dataclasses

    from megamamba import MambaConfig
    from megamamba.parallel.groups import ParallelGroups, init_distributed
    from megamamba.pipelines.loop.engine import InitialState
    from megamamba.pipelines.stages.names import load_mamba_state_dict, mamba_state_dict
    from megamamba.pipelines.stages.pipeline_module import build_pipeline_module

    init_distributed()
    groups = ParallelGroups(tensor_parallel_size=2, pipeline_parallel_size=2)
    tp = groups.tensor_parallel()
    out = []
    for path, tied in cases:
        config = dataclasses.replace(MambaConfig.from_json(path), n_layer=3, tie_embeddings=tied)
        stage = build_pipeline_module(config, groups.topology, "type:Block", 0, tp)
        load_mamba_state_dict(stage, InitialState(config, SEED), config, tp)
        names = sorted(n for n, _ in stage.named_parameters())
        state = {k: v.detach().clone() for k, v in mamba_state_dict(stage, config, tp).items()}
        out.append((groups.pipe_rank, names, state))
    return out


@pytest.fixture(scope="module")
def stage_states():
    cases = [(str(ROOT / path), tied) for path, tied in CASES]
    per_rank = run_ranks(_stage_states, 4, args=(cases,), init_process_group=False, timeout=240)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES))]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{p.split('/')[-1]}-tied={t}" for p, t in CASES])
def test_stages_gathered_over_tp_give_back_the_full_mamba_ssm_state_dict(stage_states, case):
    import dataclasses

    from megamamba import MambaConfig, MambaLM

    path, tied = CASES[case]
    results = stage_states[case]
    config = dataclasses.replace(MambaConfig.from_json(ROOT / path), n_layer=3, tie_embeddings=tied)
    torch.manual_seed(SEED)
    expected = MambaLM(config).state_dict()  # the single-device model: stages hold its weights bit for bit
    merged = {}
    for _, names, state in results:
        assert all(n.split(".")[0].isdigit() or n.startswith("tied_modules.embed.") for n in names), names
        merged.update(state)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    first, last = [r for r in results if r[0] == 0], [r for r in results if r[0] == 1]
    assert "backbone.embedding.weight" in first[0][2] and "backbone.norm_f.weight" in last[0][2]
    assert ("lm_head.weight" in last[0][2]) and (tied == ("backbone.embedding.weight" in last[0][2]))
