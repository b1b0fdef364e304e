"""Through the real `deepspeed` launcher: (1,1,1), (1,2,2) and (2,2,2) train, log and refuse bad layouts.

What only the launcher shows: its environment and argument passing (--local_rank), the exit
status of the job, the console on one rank, files written where the flags say.
"""

import socket
import subprocess
import sys

import pytest

from distributed import free_port
from train_entry import ROOT, TRAIN_PY
from train_runs import DEEPSPEED, losses, relative_curve_error

pytestmark = pytest.mark.slow

NAMES = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mem_peak_gb"}


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_single_rank_run_logs_every_metric_once_per_step(train_reference, mixer):
    run = train_reference(mixer)
    records = run["records"]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert NAMES <= set(r), r
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and r["mem_peak_gb"] > 0
    assert "val_loss" in records[-1] and "mfu" not in records[-1]
    console = [line for line in run["stdout"].splitlines() if "| loss " in line]
    assert len(console) == 5, run["stdout"][-2000:]


# (dp, tp, pp), mixer, extra flags; at 8 ranks one mixer. (2,2,2) without sequence parallelism sends the
# stage boundary TP-partitioned (DeepSpeed's pipe_partitioned); with it, whole.
LAUNCHED = [
    ((1, 2, 2), "mamba1", ["--sequence-parallel"]),
    ((1, 2, 2), "mamba2", ["--log-dir", "tb"]),
    ((2, 2, 2), "mamba1", []),
]


def _ranks(line: str, world: int) -> list:
    """The ranks an optimizer-state line names: 'every rank' or 'ranks 0-1,4'."""
    who = line.split(":")[0].removeprefix("optimizer state, ")
    if who == "every rank":
        return list(range(world))
    spans = [span.split("-") for span in who.removeprefix("ranks ").split(",")]
    return [r for span in spans for r in range(int(span[0]), int(span[-1]) + 1)]


def _launched(train_runs, layout, mixer, extra):
    dp, tp, pp = layout
    run = train_runs.launched(
        dp * tp * pp, mixer, ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp), *extra]
    )
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    return run


@pytest.mark.parametrize("layout, mixer, extra", LAUNCHED, ids=[f"{m}-{lay}-{' '.join(e)}" for lay, m, e in LAUNCHED])
def test_launched_layout_trains_the_single_rank_loss_curve(train_runs, train_reference, layout, mixer, extra):
    run = _launched(train_runs, layout, mixer, extra)
    ref = train_reference(mixer)["records"]
    error = relative_curve_error(losses(run["records"]), losses(ref))
    print(f"{mixer} {layout} {' '.join(extra)} (launcher): max relative loss difference to (1,1,1) {error:.1e}")
    assert error <= 1e-4, (losses(run["records"]), losses(ref))
    assert relative_curve_error(losses(run["records"], "grad_norm"), losses(ref, "grad_norm")) <= 1e-5
    world = layout[0] * layout[1] * layout[2]
    # rank 0 prints the optimizer state of every rank, one line per distinct value; ZeRO-1: 12 B / param / dp
    lines = [line for line in run["stdout"].splitlines() if "optimizer state bytes" in line]
    assert 1 <= len(lines) <= layout[2] and all("= 12.000 x stage parameters / dp" in line for line in lines), lines
    assert sorted(rank for line in lines for rank in _ranks(line, world)) == list(range(world)), lines
    console = [line for line in run["stdout"].splitlines() if "| loss " in line]
    assert len(console) == 5, "the console log comes from one rank only"


def test_tensorboard_gets_every_metric_name_at_every_step(train_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _launched(train_runs, *LAUNCHED[1])
    events = EventAccumulator(str(run["dir"] / "tb"))
    events.Reload()
    assert NAMES - {"step"} | {"val_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2, 3, 4]


def test_an_invalid_layout_stops_the_launched_job_before_training_with_one_message(train_runs, tmp_path):
    ds = train_runs.ds_config(zero_optimization={"stage": 2})
    cmd = [
        str(DEEPSPEED),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(TRAIN_PY),
        "--deepspeed_config",
        ds,
        "--model-config",
        train_runs.model_config("mamba2"),
        "--pipeline-parallel-size",
        "2",
        "--train-iters",
        "5",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    message = "train.py: error: ZeRO stage 2 with pipeline parallel size 2"
    # Once per rank that gets that far: DeepSpeed's launch.py kills the other rank when the first one exits (on a
    # loaded machine before the slower one has printed).
    count = (proc.stdout + proc.stderr).count(message)
    assert 1 <= count <= 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| loss " not in proc.stdout


def test_the_script_exits_2_with_the_message_on_stderr(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(TRAIN_PY),
            "--deepspeed_config",
            str(ROOT / "launch/configs/tiny-cpu.json"),
            "--model-config",
            str(ROOT / "launch/models/tiny-mamba2.json"),
            "--tensor-parallel-size",
            "3",
            "--train-iters",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"WORLD_SIZE": "4", "PATH": ""},
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == ["train.py: error: world size 4 is not a multiple of tensor x pipeline parallel size 3 x 1 = 3"]


def test_a_master_port_in_use_is_one_line_naming_it_and_exit_2(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = subprocess.run(
            [DEEPSPEED, "--num_gpus", "1", "--master_port", str(port), str(TRAIN_PY)]
            + ["--deepspeed_config", str(ROOT / "launch/configs/tiny-cpu.json")]
            + ["--model-config", str(ROOT / "launch/models/tiny-mamba1.json"), "--train-iters", "2"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == [
        f"train.py: error: master port {port} on 127.0.0.1 is in use by another process (another run?): "
        f"give the launcher a free one, e.g. deepspeed --master_port {port + 1} ..."
    ], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
