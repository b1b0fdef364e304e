"""The metrics logger: docs/architecture.md's names to the console, JSON lines and TensorBoard, on the
enabled rank only."""

import json

import pytest

from megamamba.observe.metrics import MetricsLogger

RECORDS = [
    {
        "step": 0,
        "loss": 5.5,
        "lr": 1e-3,
        "grad_norm": 2.0,
        "tokens_per_s": 100.0,
        "tflops_per_device": 0.5,
        "mem_peak_gb": 1.25,
        "val_loss": None,
        "mfu": None,
    },
    {
        "step": 10,
        "loss": 4.0,
        "lr": 9e-4,
        "grad_norm": 1.5,
        "tokens_per_s": 110.0,
        "tflops_per_device": 0.6,
        "mem_peak_gb": 1.5,
        "val_loss": 4.25,
        "mfu": 0.3,
    },
]


def test_jsonl_gets_one_object_per_record_without_unknown_values(tmp_path, capsys):
    path = tmp_path / "sub" / "m.jsonl"
    logger = MetricsLogger(True, jsonl_path=str(path))
    for r in RECORDS:
        logger.log(r)
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {k: v for k, v in RECORDS[0].items() if v is not None}
    assert lines[1] == RECORDS[1]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 0 | loss 5.5 | lr 0.001 | grad_norm 2 |") and "val_loss" not in out[0]
    assert "val_loss 4.25 | mfu 0.3" in out[1]


def test_tensorboard_holds_the_same_names_at_the_logged_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(True, tensorboard_dir=str(tmp_path / "tb"))
    for r in RECORDS:
        logger.log(r)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mem_peak_gb", "val_loss", "mfu"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 5.5), (10, 4.0)]
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(10, 4.25)]


def test_a_disabled_logger_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(False, jsonl_path=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    logger.log(RECORDS[0])
    logger.close()
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()
    assert capsys.readouterr().out == ""


def test_empty_paths_turn_the_jsonl_and_tensorboard_outputs_off(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = MetricsLogger(True, jsonl_path="", tensorboard_dir="")
    logger.log(RECORDS[0])
    logger.close()
    assert "loss 5.5" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_an_unknown_metric_name_is_refused(tmp_path):
    logger = MetricsLogger(True, jsonl_path=str(tmp_path / "m.jsonl"))
    with pytest.raises(KeyError, match="throughput"):
        logger.log({"step": 0, "throughput": 1.0})
