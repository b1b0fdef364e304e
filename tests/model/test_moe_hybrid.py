"""A tiny mixture-of-experts hybrid (launch/models/tiny-moe-hybrid.json, MEM*E): it trains in process with its
router losses in the gradient, recomputation included; its FLOPs count the active parameters only."""

import dataclasses

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.model.flops import layer_flops
from megamamba.model.moe_router import Router, update_expert_biases
from train_entry import ROOT

CONFIG = ROOT / "launch" / "models" / "tiny-moe-hybrid.json"


@pytest.fixture(scope="module")
def config() -> MambaConfig:
    return MambaConfig.from_json(CONFIG)


def test_the_tiny_moe_hybrid_trains_its_loss_falling_and_its_expert_biases_moving(config):
    torch.manual_seed(0)
    model = MambaLM(dataclasses.replace(config, moe_cfg={**config.moe_cfg, "expert_bias": True}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        update_expert_biases(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    biases = [m.e_score_correction_bias for m in model.modules() if isinstance(m, Router)]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)


def test_recomputed_layers_give_the_same_gradients_router_losses_included(config):
    moe_cfg = {**config.moe_cfg, "expert_bias": True}
    experts_only = dataclasses.replace(config, n_layer=3, hybrid_layer_pattern="E*E", moe_cfg=moe_cfg)
    torch.manual_seed(0)
    plain = MambaLM(experts_only)
    recomputed = MambaLM(experts_only, checkpoint_interval=2)
    recomputed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    for model in (plain, recomputed):
        model(ids, labels=ids).backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    router = plain.backbone.layers[0].mixer.gate
    assert router.received.sum() == 2 * 16 * config.moe_options.top_k


def test_the_flops_of_an_moe_layer_count_its_active_parameters(config):
    model = MambaLM(config)
    moe, o = model.backbone.layers[1].mixer, config.moe_options
    active = (
        moe.gate.weight.numel()
        + o.top_k * (moe.experts.up_proj[0].numel() + moe.experts.down_proj[0].numel())
        + sum(p.numel() for p in moe.shared_experts.parameters())
    )
    assert layer_flops(config, 32)[2] == 2 * active
