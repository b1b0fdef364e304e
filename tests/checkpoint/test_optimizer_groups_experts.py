"""A checkpoint's optimizer groups do not depend on the expert-parallel size: a group of split experts, as
expert parallelism makes them, is recorded as part of the group it was split from; and optimizer state restores
with none for the parameters the optimizer leaves alone."""

import torch

from megamamba.checkpoint.state import optimizer_groups, restore_optimizer_state
from megamamba.pipelines.deepspeed_internals import expert_param_groups


def test_the_expert_group_is_recorded_in_the_group_it_was_split_from():
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(3, 3), "experts": torch.nn.Linear(3, 3, bias=False)})
    groups = [
        {"params": [model["dense"].weight, model["experts"].weight], "weight_decay": 0.1},
        {"params": [model["dense"].bias], "weight_decay": 0.0},
    ]
    split = expert_param_groups(groups, lambda p: p is model["experts"].weight, ep_size=2)
    assert len(split) == 3
    whole = optimizer_groups(torch.optim.AdamW(groups), model)
    assert optimizer_groups(torch.optim.AdamW(split), model) == whole
    assert whole[0]["params"] == ["dense.weight", "experts.weight"]


def test_optimizer_state_restores_without_any_for_parameters_the_optimizer_leaves_alone():
    """A frozen parameter (an MoE router's expert bias) has no optimizer state to save or restore."""
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(3, 3)})
    model.register_parameter("bias", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model["dense"](torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {n: dict(optimizer.state[p]) for n, p in model.named_parameters() if p.requires_grad}
    fresh = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    restore_optimizer_state(fresh, model, state, optimizer_groups(optimizer, model))
    weight = model["dense"].weight
    assert torch.equal(fresh.state[weight]["exp_avg"], optimizer.state[weight]["exp_avg"])
