"""DeepSpeed's pipeline engine at pp = 2 over a mixture-of-experts hybrid gives every parameter, the routers'
included, the single-device model's gradient: the router losses travel between the stages beside the hidden
states (zero before the first E block) and reach the training loss on the last stage."""

import dataclasses

import pytest
import torch

from train_entry import ROOT

SEED = 7
SEQ = 32
MICRO_BATCHES = 2
LOSSES = {"aux_loss_coeff": 0.5, "z_loss_coeff": 0.5}  # large enough to move the router's gradient
CASES = [  # pattern with the stage marks, whether the batches hold document ids
    ("ME|M*E", False),
    ("M|EM*E", True),
]


def _config(pattern):
    from megamamba import MambaConfig

    config = MambaConfig.from_json(ROOT / "launch/models/tiny-moe-hybrid.json")
    return dataclasses.replace(config, hybrid_layer_pattern=pattern, moe_cfg={**config.moe_cfg, **LOSSES})


def _batches(config, with_documents):
    """MICRO_BATCHES of (ids, labels, seq_idx or None), two sequences each."""
    generator = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=generator)
        documents = (torch.arange(SEQ) >= SEQ // 3).to(torch.int32).expand(2, SEQ).contiguous()
        seq_idx = documents if with_documents else None
        out.append((ids, torch.roll(ids, -1, dims=1), seq_idx))
    return out


class _RecordingSGD(torch.optim.SGD):
    """SGD with learning rate 0 that keeps the gradients its step sees, by parameter."""

    def step(self, closure=None):
        self.seen = {p: p.grad.detach().clone() for group in self.param_groups for p in group["params"]}


def _pipeline_gradients(cases):
    """Per case: this stage's gradients after one train_batch, by mamba_ssm name."""
    import deepspeed

    from megamamba.parallel.groups import ParallelGroups, init_distributed
    from megamamba.pipelines.loop.engine import InitialState
    from megamamba.pipelines.stages.names import load_mamba_state_dict, to_mamba
    from megamamba.pipelines.stages.pipeline_module import build_pipeline_module

    init_distributed()
    groups = ParallelGroups(pipeline_parallel_size=2)
    engine_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    out = []
    for pattern, with_documents in cases:
        config = _config(pattern)
        stage = build_pipeline_module(config, groups.topology, "cost", seq_length=SEQ)
        load_mamba_state_dict(stage, InitialState(config, SEED), config, None)
        optimizer = _RecordingSGD([p for p in stage.parameters() if p.requires_grad], lr=0.0)
        engine, *_ = deepspeed.initialize(model=stage, optimizer=optimizer, config=engine_config)
        data = [
            ((ids, seq_idx) if seq_idx is not None else ids, labels)
            for ids, labels, seq_idx in _batches(config, with_documents)
        ]
        engine.train_batch(iter(data))
        names = {p: to_mamba(n, config) for n, p in stage.named_parameters()}
        out.append({names[p]: g for p, g in optimizer.seen.items()})
    return out


@pytest.fixture(scope="module")
def pipeline_gradients():
    from distributed import run_ranks

    per_rank = run_ranks(_pipeline_gradients, 2, args=(CASES,), init_process_group=False, timeout=240)
    return [[rank[i] for rank in per_rank] for i in range(len(CASES))]


def _single_device_gradients(config, with_documents):
    from megamamba import MambaLM

    torch.manual_seed(SEED)
    model = MambaLM(config)
    for ids, labels, seq_idx in _batches(config, with_documents):
        (model(ids, labels=labels, seq_idx=seq_idx) / MICRO_BATCHES).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[p for p, _ in CASES])
def test_pipeline_gradients_equal_the_single_device_models_router_losses_included(pipeline_gradients, case):
    pattern, with_documents = CASES[case]
    config = _config(pattern)
    expected = _single_device_gradients(config, with_documents)
    without_losses = dataclasses.replace(config, moe_cfg={**config.moe_cfg, "aux_loss_coeff": 0, "z_loss_coeff": 0})
    unbalanced = _single_device_gradients(without_losses, with_documents)
    stages = pipeline_gradients[case]
    assert set(stages[0]) | set(stages[1]) == set(expected)
    for name, grad in expected.items():
        for stage in stages:
            if name in stage:
                assert torch.allclose(stage[name], grad, rtol=1e-4, atol=1e-6), name
    routers = [n for n in expected if n.endswith("mixer.gate.weight")]
    assert len(routers) == 2
    for name in routers:
        assert not torch.allclose(unbalanced[name], expected[name], rtol=1e-4, atol=1e-6), name
