"""The console's pieces without a run: ETA arithmetic, step lines, optimizer-state grouping, parameter count."""

import json

from megamamba.config import MambaConfig
from megamamba.model.lm import MambaLM
from megamamba.observe.metrics import format_record
from megamamba.observe.run_console import StepClock, count_parameters, optimizer_state_lines
from megamamba.pipelines.config.layout import Layout
from train_entry import ROOT


def test_eta_uses_the_rate_after_the_first_step():
    clock = StepClock(job_start=0.0, loop_start=10.0, train_iters=10)
    assert clock.step_done(0, now=15.0) == (15.0, 45.0)  # first step: its own 5 s x 9 steps left
    assert clock.step_done(2, now=17.0) == (17.0, 7.0)  # then 1 s per step x 7 left
    assert clock.step_done(9, now=24.0) == (24.0, 0.0)


def test_a_resumed_run_counts_its_eta_to_the_same_total():
    clock = StepClock(job_start=0.0, loop_start=0.0, train_iters=10)
    clock.step_done(6, now=2.0)
    assert clock.step_done(8, now=4.0) == (4.0, 1.0)


def test_step_line_shows_step_of_total_and_times():
    record = {"step": 3, "loss": 5.0, "elapsed_s": 3725.2, "eta_s": 59.9}
    assert format_record(record, total_steps=100) == "step 3/100 | loss 5 | elapsed 1:02:05 | ETA 0:00:59"
    assert format_record({"step": 3, "loss": 5.0}) == "step 3 | loss 5"


def test_optimizer_state_is_one_line_when_ranks_agree_and_one_per_distinct_value_otherwise():
    layout = Layout(world_size=4, dp=2, tp=1, pp=2, micro_batch_size=1, grad_accum=4)
    same = optimizer_state_lines(layout, [(10, 60)] * 4)
    assert len(same) == 1 and same[0].startswith("optimizer state, every rank: dp=2 tp=1 pp=2")
    assert same[0].endswith("optimizer state bytes 60 = 12.000 x stage parameters / dp")
    split = optimizer_state_lines(layout, [(10, 60), (10, 60), (20, 120), (10, 60)])
    assert [line.split(":")[0] for line in split] == ["optimizer state, ranks 0-1,3", "optimizer state, ranks 2"]


def test_parameter_count_equals_the_built_models():
    for name in ("tiny-mamba1", "tiny-mamba2"):
        config = MambaConfig.from_dict(json.loads((ROOT / f"launch/models/{name}.json").read_text()))
        for tie in (True, False):
            config.tie_embeddings = tie
            assert count_parameters(config) == sum(p.numel() for p in MambaLM(config).parameters()), (name, tie)


def test_summary_names_a_deepspeed_schedule_bf16_and_warns_about_the_builtin_corpus():
    from megamamba.data.training_data import training_data
    from megamamba.observe.run_console import startup_summary
    from megamamba.schedule.lr_schedule import DeepSpeedSchedule

    config = MambaConfig.from_dict(json.loads((ROOT / "launch/models/tiny-mamba2.json").read_text()))
    layout = Layout(world_size=2, dp=2, tp=1, pp=1, micro_batch_size=2, grad_accum=2)
    lines = startup_summary(
        model=config,
        layout=layout,
        seq_length=32,
        train_iters=10,
        schedule=DeepSpeedSchedule(1e-3, 0.0, 4, "linear", "linear", 10, 0.0, 0.0),
        engine_config={"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 2}},
        data=training_data(config, "bytes", [], [], 32, 8, 1234),
        total_params=100,
        stage_params=(40, 60),
        save=None,
        load=None,
        save_interval=0,
        keep_last=None,
    )
    text = "\n".join(lines)
    assert "parameters 100 (100) total, 40..60 per rank" in lines[0]
    assert "global batch 8 x seq 32 = 256 tokens per step" in text and "10 steps = 2560 tokens" in text
    assert "(DeepSpeed scheduler: linear warm-up from 0)" in text
    assert "precision: bf16 autocast" in text and "ZeRO stage 2" in text and "no --save" in text
    assert sum(line.startswith("train.py: warning: no --data") for line in lines) == 1
