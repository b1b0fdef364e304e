"""The memory plan behind launch/configs/nemotron-3-nano-30b-a3b.json's layout (docs/moe.md): the 30B-A3B-shaped
model at sequence 8192, bf16 autocast, recomputation, ZeRO-2 and EP 8 fits 80 GB GPUs on 16 of them (two nodes,
dp 16), and does not on 8 (dp = EP: no rank shares its experts' float32 state)."""

import pytest

from megamamba import MambaConfig
from megamamba.pipelines.config.layout import Layout, engine_config
from megamamba.pipelines.config.run_plan import read_deepspeed_config
from megamamba.pipelines.memory.fit import RESERVED
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from train_entry import ROOT

MODEL = MambaConfig.from_json(ROOT / "launch/models/nemotron-3-nano-30b-a3b.json")
DS_CONFIG = read_deepspeed_config(str(ROOT / "launch/configs/nemotron-3-nano-30b-a3b.json"))
USABLE_80GB = 80 * 2**30 - RESERVED  # the planner's "80 GB": launch/plan.py --gpu-memory 80
SEQ = 8192


def _worst_rank_bytes(gpus: int) -> int:
    micro, accum = DS_CONFIG["train_micro_batch_size_per_gpu"], DS_CONFIG["gradient_accumulation_steps"]
    layout = Layout(gpus, gpus, 1, 1, micro, accum, 1, 8)
    shape = RunShape.of_run(MODEL, layout, engine_config(DS_CONFIG, layout, None, False), SEQ, "cost", 1, False)
    return plan_memory(shape).worst.total


@pytest.mark.parametrize("gpus, fits", [(16, True), (8, False)])
def test_the_30b_a3b_layout_fits_80gb_gpus_on_two_nodes_and_not_on_one(gpus, fits):
    need = _worst_rank_bytes(gpus)
    assert (need <= USABLE_80GB) == fits, f"{gpus} GPUs: {need / 2**30:.1f} GiB per rank"
