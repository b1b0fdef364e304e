"""A checkpoint's optimizer groups do not depend on the expert-parallel size: a group of split experts, as
expert parallelism makes them, is recorded as part of the group it was split from."""

import torch

from megamamba.checkpoint.state import optimizer_groups
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
