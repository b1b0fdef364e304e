"""A resumed optimizer's state sits where torch's AdamW keeps it: each tensor on its parameter's device in
the dtype AdamW gives it, `step` a float32 tensor on the device when fused or capturable, else on the host."""

import pytest
import torch

from checkpoint_fixtures import tiny, train_step
from megamamba.checkpoint import adam_step, load_training_checkpoint, open_checkpoint, save_training_checkpoint
from megamamba.model.lm import MambaLM
from megamamba.schedule.lr_schedule import LRSchedule


def run(seed: int, options: dict) -> tuple:
    torch.manual_seed(seed)
    model = MambaLM(tiny("Mamba1"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **options)
    return model, optimizer, LRSchedule(1e-2, 1e-3, 2, 8).scheduler(optimizer)


def placement(optimizer) -> dict:
    return {
        (i, key): (v.dtype, v.device, tuple(v.shape))
        for i, p in enumerate(optimizer.param_groups[0]["params"])
        for key, v in optimizer.state[p].items()
    }


@pytest.mark.parametrize("options", [{"fused": True}, {"foreach": False}], ids=["fused", "for-loop"])
def test_resumed_adamw_state_has_the_devices_and_dtypes_of_a_stepped_one(tmp_path, options):
    model, optimizer, scheduler = run(0, options)
    train_step(model, optimizer, scheduler, 0)
    save_training_checkpoint(str(tmp_path), 1, model, optimizer, scheduler)
    model2, resumed, scheduler2 = run(1, options)
    load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model2, resumed, scheduler2)
    assert placement(resumed) == placement(optimizer)
    steps = [s["step"] for s in resumed.state.values()]
    assert all(torch.is_tensor(s) and s.dtype == torch.float32 and s.item() == 1 for s in steps)


@pytest.mark.parametrize(
    "group, device",
    [({"fused": True}, "meta"), ({"capturable": True}, "meta"), ({"fused": None, "capturable": False}, "cpu")],
)
def test_adam_step_is_built_where_torch_adamw_builds_it(group, device):
    param = torch.empty(3, device="meta")
    step = adam_step(7, param, group)
    assert (step.dtype, step.device.type, step.shape) == (torch.float32, device, ())
    if device == "cpu":
        assert step.item() == 7
