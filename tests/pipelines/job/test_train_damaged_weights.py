"""Weights holding a NaN or an infinity stop a run at start-up: `--init-from` a model folder and `--load` a
checkpoint each end with one line naming the first such tensor, exit status 2, before any step; the folder
read is byte-identical afterwards. (Without the check, --init-from trained 5 NaN steps.)

Each refusal is launch/train.py's main on one spawned rank (the check runs once the trainer is built).
"""

import contextlib
import io

import pytest
import torch

from distributed import run_ranks
from megamamba.checkpoint import save_training_checkpoint
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.config import MambaConfig
from megamamba.model.lm import MambaLM
from megamamba.optim import param_groups
from resume_runs import snapshot
from train_entry import run_train
from train_runs import COMMON

pytestmark = pytest.mark.slow  # a spawned rank: import, process group and trainer, ~7-9 s each

DAMAGED = "backbone.layers.2.mixer.A_log"
MESSAGE = (
    f'tensor "{DAMAGED}" holds 2 NaN / inf values (first at index (1,)); the weights are damaged: load another '
    "checkpoint"
)


def train_refusal(argv, extensions_dir) -> tuple:
    """(exit status, stderr) of launch/train.py's main on this rank."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            run_train(argv, extensions_dir)
            status = 0
        except SystemExit as e:
            status = e.code
    return status, err.getvalue()


@pytest.fixture(scope="module")
def damaged(train_runs, tmp_path_factory):
    """{"folder": a model folder, "checkpoint": a checkpoint, "argv": the run's flags}: the run's model with
    a NaN and an infinity in the last layer's A_log."""
    root = tmp_path_factory.mktemp("damaged_weights")
    config = train_runs.model_config("mamba2")
    model = MambaLM(MambaConfig.from_json(config))
    with torch.no_grad():
        model.get_parameter(DAMAGED)[1] = float("nan")
        model.get_parameter(DAMAGED)[3] = float("inf")
    save_model_folder(model, str(root / "folder"))
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2, betas=(0.9, 0.95))
    checkpoint = save_training_checkpoint(str(root / "save"), 3, model, optimizer)
    argv = ["--deepspeed_config", train_runs.ds_config(), "--model-config", config, *COMMON]
    return {"folder": str(root / "folder"), "checkpoint": checkpoint, "argv": argv, "root": root}


def refused(train_runs, damaged, flags) -> tuple:
    """(exit status, stderr lines, metrics written?) of the run with `flags`, the folders checked unchanged."""
    before = snapshot(damaged["root"])
    metrics = damaged["root"] / "metrics.jsonl"
    argv = [*damaged["argv"], "--metrics-jsonl", str(metrics), *flags]
    ((status, err),) = run_ranks(
        train_refusal, 1, args=(argv, train_runs.extensions_dir), init_process_group=False, timeout=300
    )
    assert snapshot(damaged["root"]) == before
    return status, err.splitlines(), metrics.exists()


def test_init_from_a_folder_holding_nan_is_refused_naming_the_tensor(train_runs, damaged):
    status, lines, wrote_metrics = refused(train_runs, damaged, ["--init-from", damaged["folder"]])
    assert (status, lines, wrote_metrics) == (2, [f"train.py: error: {damaged['folder']}: {MESSAGE}"], False)


def test_load_of_a_checkpoint_holding_nan_is_refused_naming_the_tensor(train_runs, damaged):
    status, lines, wrote_metrics = refused(train_runs, damaged, ["--load", damaged["checkpoint"]])
    assert (status, lines, wrote_metrics) == (2, [f"train.py: error: {damaged['checkpoint']}: {MESSAGE}"], False)
