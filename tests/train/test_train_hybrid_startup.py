"""A hybrid run's start-up: the summary counts its layer kinds."""
import json

from megamamba.config import MambaConfig
from megamamba.data.training_data import training_data
from megamamba.model.lm import MambaLM
from megamamba.observe.run_console import count_parameters, startup_summary
from megamamba.pipelines.config.layout import Layout
from megamamba.schedule.lr_schedule import LRSchedule
from train_entry import ROOT

TINY_HYBRID = json.loads((ROOT / "launch/models/tiny-hybrid.json").read_text())


def test_the_start_up_summary_counts_a_hybrids_layer_kinds_and_parameters():
    config = MambaConfig.from_dict(TINY_HYBRID)
    total = sum(p.numel() for p in MambaLM(config).parameters())
    lines = startup_summary(
        model=config, layout=Layout(world_size=1, dp=1, tp=1, pp=1, micro_batch_size=2, grad_accum=4),
        seq_length=32, train_iters=3, schedule=LRSchedule(1e-3, 1e-4, 0, 3, "cosine"), engine_config={},
        data=training_data(config, "bytes", [], [], 32, 8, 1234), total_params=count_parameters(config),
        stage_params=(1, 1), save=None, load=None, save_interval=0, keep_last=None)
    assert lines[0].startswith(f"run: Mamba2, 5 layers (2 Mamba2, 1 attention, 2 MLP), d_model 64 | parameters "
                               f"{total} ")
