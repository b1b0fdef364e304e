"""The DeepSpeed config's monitor blocks: csv_monitor and wandb next to TensorBoard, with DeepSpeed's keys.

wandb is not installed here: its path runs against a fake `wandb` module (tests/observe/fake_wandb)
that records its calls as JSON lines in $FAKE_WANDB_CALLS.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megamamba.observe.metrics import MetricsLogger
from megamamba.observe.monitor_config import Monitors, monitors_from_config
from train_entry import ROOT, TRAIN_PY, load_train_script

FAKE_WANDB = Path(__file__).parent / "fake_wandb"
RECORDS = [
    {"step": 0, "loss": 5.5, "lr": 1e-3, "val_loss": None},
    {"step": 10, "loss": 4.0, "lr": 9e-4, "val_loss": 4.25},
]


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    """`import wandb` finds the fake; returns the file its calls are recorded in."""
    calls = tmp_path / "wandb_calls.jsonl"
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    monkeypatch.syspath_prepend(str(FAKE_WANDB))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    yield calls
    sys.modules.pop("wandb", None)


def _calls(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _csv(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_blocks_resolve_with_deepspeeds_defaults_and_keys():
    assert monitors_from_config({}, None) == Monitors(None, None, None)
    config = {"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": True, "output_path": "out", "job_name": "j"}}
    assert monitors_from_config(config, None) == Monitors("DeepSpeedJobName", "out/j", None)


def test_log_dir_takes_the_place_of_the_tensorboard_block():
    assert monitors_from_config({"tensorboard": {"enabled": True, "job_name": "j"}}, "mine").tensorboard_dir == "mine"


def test_a_block_without_enabled_true_is_off():
    config = {"csv_monitor": {"output_path": "out"}, "wandb": {"enabled": False}, "comet": {"enabled": False}}
    assert monitors_from_config(config, None) == Monitors(None, None, None)


@pytest.mark.parametrize(
    "block, message",
    [
        (
            {"csv_monitor": {"enabled": True, "outputpath": "x"}},
            "\"csv_monitor\" block has the unknown key 'outputpath'",
        ),
        ({"wandb": {"enabled": True, "project": 3}}, '"wandb".project is 3; it must be str'),
        ({"tensorboard": "on"}, "\"tensorboard\" is 'on'; it must be an object"),
        ({"comet": {"enabled": True}}, "comet is not supported here"),
    ],
)
def test_a_block_that_cannot_work_is_refused_by_name(block, message):
    with pytest.raises(ValueError, match=message):
        monitors_from_config(block, None)


def test_wandb_enabled_without_wandb_installed_is_refused_with_the_install_command():
    with pytest.raises(ValueError, match="wandb is not installed: pip install wandb"):
        monitors_from_config({"wandb": {"enabled": True}}, None)


def test_train_py_refuses_wandb_without_wandb_in_one_line_with_exit_2(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps({**json.loads((ROOT / "launch/configs/tiny-cpu.json").read_text()), "wandb": {"enabled": True}})
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(TRAIN_PY),
            "--deepspeed_config",
            str(ds),
            "--model-config",
            str(ROOT / "launch/models/tiny-mamba2.json"),
            "--train-iters",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"WORLD_SIZE": "1", "PATH": ""},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "pip install wandb" in errors[0], proc.stderr[-2000:]


def test_deepspeed_never_sees_the_monitor_blocks(tmp_path, fake_wandb):
    script = load_train_script()
    ds, model = tmp_path / "ds.json", ROOT / "launch/models/tiny-mamba2.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "tensorboard": {"enabled": True},
                "csv_monitor": {"enabled": True},
                "wandb": {"enabled": True},
                "comet": {"enabled": False},
            }
        )
    )
    plan = script.prepare(
        script.parse_args(["--deepspeed_config", str(ds), "--model-config", str(model), "--train-iters", "3"]), 1
    )
    assert not {"tensorboard", "csv_monitor", "wandb", "comet"} & set(plan.engine_config)
    assert plan.monitors.csv_dir == "DeepSpeedJobName" and plan.monitors.wandb["project"] == "deepspeed"


def test_csv_files_have_deepspeeds_layout_one_per_metric(tmp_path):
    logger = MetricsLogger(True, csv_dir=str(tmp_path / "job"))
    for record in RECORDS:
        logger.log(record)
    logger.close()
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["loss.csv", "lr.csv", "val_loss.csv"]
    assert _csv(tmp_path / "job/loss.csv") == [["step", "loss"], ["0", "5.5"], ["10", "4.0"]]
    assert _csv(tmp_path / "job/val_loss.csv") == [["step", "val_loss"], ["10", "4.25"]]


def test_a_resumed_run_appends_to_the_csv_files_without_a_second_header(tmp_path):
    for record in RECORDS:
        logger = MetricsLogger(True, csv_dir=str(tmp_path))
        logger.log(record)
        logger.close()
    assert _csv(tmp_path / "loss.csv") == [["step", "loss"], ["0", "5.5"], ["10", "4.0"]]


def test_wandb_gets_deepspeeds_init_arguments_and_one_log_per_record_at_its_step(fake_wandb):
    logger = MetricsLogger(True, wandb={"project": "p", "group": "g", "entity": "team"})
    for record in RECORDS:
        logger.log(record)
    logger.close()
    assert _calls(fake_wandb) == [
        {"call": "init", "kwargs": {"project": "p", "group": "g", "entity": "team"}},
        {"call": "log", "data": {"loss": 5.5, "lr": 1e-3}, "step": 0},
        {"call": "log", "data": {"loss": 4.0, "lr": 9e-4, "val_loss": 4.25}, "step": 10},
        {"call": "finish"},
    ]


def test_a_disabled_logger_starts_no_wandb_run_and_writes_no_csv(tmp_path, fake_wandb):
    logger = MetricsLogger(False, csv_dir=str(tmp_path / "csv"), wandb={"project": "p"})
    logger.log(RECORDS[0])
    logger.close()
    assert not fake_wandb.exists() and not (tmp_path / "csv").exists()


@pytest.mark.slow
def test_a_launched_run_writes_csv_and_wandb_values_equal_to_the_jsonl(train_runs, tmp_path, monkeypatch):
    calls = tmp_path / "wandb_calls.jsonl"
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_WANDB), os.environ.get("PYTHONPATH", "")]))
    ds = train_runs.ds_config(
        csv_monitor={"enabled": True, "output_path": "csv", "job_name": "tiny"},
        wandb={"enabled": True, "team": "t", "group": "g", "project": "p"},
    )
    run = train_runs.launched(2, "mamba2", ds_config=ds)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    records = run["records"]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "elapsed_s"):
        rows = _csv(run["dir"] / "csv/tiny" / f"{name}.csv")
        assert rows[0] == ["step", name]
        assert [(int(s), float(v)) for s, v in rows[1:]] == [(r["step"], r[name]) for r in records if name in r]
    wandb = _calls(calls)
    assert wandb[0] == {"call": "init", "kwargs": {"project": "p", "group": "g", "entity": "t"}}
    assert wandb[1:-1] == [
        {"call": "log", "data": {k: v for k, v in r.items() if k != "step"}, "step": r["step"]} for r in records
    ]
    assert wandb[-1] == {"call": "finish"}
