"""Expert-parallel layouts that cannot run are refused before any process group, with one message naming the
values and the rule: a size that does not divide the experts or the data x context ranks, a model without
mixture-of-experts layers, ZeRO-3, ZeRO without reduce-scatter."""

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import LayoutError, check_run, resolve_layout
from train_entry import ROOT

MOE = MambaConfig.from_json(ROOT / "launch/models/tiny-moe-hybrid.json")  # 8 experts
DENSE = MambaConfig.from_json(ROOT / "launch/models/tiny-mamba2.json")
BATCH = {"train_micro_batch_size_per_gpu": 1}


def _check(world: int, ep: int, model=MOE, zero=None, tp=1, cp=1) -> None:
    """Check a layout, with sequence parallelism under TP."""
    ds_config = {**BATCH, **({"zero_optimization": zero} if zero else {})}
    layout = resolve_layout(world, tp, 1, ds_config, cp, ep)
    check_run(layout, ds_config, model, 32, tp > 1, None)


@pytest.mark.parametrize(
    "world, ep, tp, cp, zero",
    [(2, 2, 1, 1, {"stage": 1}), (4, 4, 1, 1, {"stage": 2}), (4, 2, 2, 1, None), (4, 4, 1, 2, {"stage": 1})],
)
def test_an_expert_parallel_size_dividing_the_experts_and_the_data_axis_is_accepted(world, ep, tp, cp, zero):
    _check(world, ep, tp=tp, cp=cp, zero=zero)


@pytest.mark.parametrize(
    "world, ep, model, zero, tp, words",
    [
        (3, 3, MOE, None, 1, ["--expert-model-parallel-size 3", "num_experts = 8"]),
        (4, 4, MOE, None, 2, ["--expert-model-parallel-size 4", "(2)", "dp x cp"]),
        (2, 2, DENSE, None, 1, ["no mixture-of-experts layers"]),
        (2, 2, MOE, {"stage": 3}, 1, ["ZeRO stage 3", "0, 1 or 2"]),
        (2, 2, MOE, {"stage": 2, "reduce_scatter": False}, 1, ["reduce_scatter false", "remove the key"]),
    ],
)
def test_an_expert_layout_that_cannot_run_is_refused_naming_the_rule(world, ep, model, zero, tp, words):
    with pytest.raises(LayoutError) as refused:
        _check(world, ep, model=model, zero=zero, tp=tp)
    assert all(w in str(refused.value) for w in words), str(refused.value)
