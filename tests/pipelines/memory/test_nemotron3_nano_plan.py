"""The memory plan behind the layout docs/moe.md gives launch/configs/nemotron-3-nano-30b-a3b.json on one node of
8 x 80 GB: the 30B-A3B-shaped model at sequence 8192 with bf16 autocast and recomputation fits at dp 1 x cp 2 x
pp 4 with EP 2 (over the context pair) and ZeRO 0; the same GPUs at dp 8, EP 8 with ZeRO-2 do not (no rank
shares its experts' float32 state)."""

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import Layout, check_run, engine_config, resolve_layout
from megamamba.pipelines.config.run_plan import read_deepspeed_config
from megamamba.pipelines.memory.fit import RESERVED
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from train_entry import ROOT

MODEL = MambaConfig.from_json(ROOT / "launch/models/nemotron-3-nano-30b-a3b.json")
DS_CONFIG = read_deepspeed_config(str(ROOT / "launch/configs/nemotron-3-nano-30b-a3b.json"))
USABLE_80GB = 80 * 2**30 - RESERVED  # the planner's "80 GB": launch/plan.py --gpu-memory 80
SEQ = 8192


def _worst_rank_bytes(layout: Layout, ds_config: dict) -> int:
    config = engine_config(ds_config, layout, None, False)
    return plan_memory(RunShape.of_run(MODEL, layout, config, SEQ // layout.cp, "cost", 1, False)).worst.total


def test_the_documented_8_gpu_layout_passes_the_start_up_checks_and_fits_80gb():
    layout = resolve_layout(8, 1, 4, DS_CONFIG, cp=2, ep=2)
    check_run(layout, DS_CONFIG, MODEL, SEQ, False, None)
    need = _worst_rank_bytes(layout, DS_CONFIG)
    assert need <= USABLE_80GB, f"{need / 2**30:.2f} GiB per rank"


def test_eight_gpus_each_holding_16_experts_without_sharing_do_not_fit():
    ds_config = {**DS_CONFIG, "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}
    layout = resolve_layout(8, 1, 1, ds_config, ep=8)
    need = _worst_rank_bytes(layout, ds_config)
    assert need > USABLE_80GB, f"{need / 2**30:.2f} GiB per rank"
