"""launch/train.py for the tests: its path, the venv's `deepspeed` launcher, the script loaded as a
module, a rank function that runs it, the environment of a run without the launcher, and the records of a
--metrics-jsonl file.

`run_train(argv)` is top-level so `tests/distributed.run_ranks` can run it on spawned ranks
(with init_process_group=False: train.py initialises DeepSpeed's process group itself).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import fault_injection
from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "launch" / "train.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def load_train_script():
    if "megamamba_train_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("megamamba_train_script", TRAIN_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["megamamba_train_script"] = module
    return sys.modules["megamamba_train_script"]


def run_train(argv, extensions_dir, faults=None):
    """One rank of a training run, with `faults` (tests/fault_injection.py's `install` keywords) injected;
    returns that rank's summary (records, optimizer-state bytes, ...)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    if faults:
        fault_injection.install(**faults)
    return load_train_script().main(list(argv))


def rank_zero_of_one() -> dict:
    """The rendezvous variables of `python launch/train.py` run as rank 0 of 1, without the launcher."""
    return dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def read_metrics(path: Path) -> list:
    """The records of a --metrics-jsonl file: its complete lines ([] before the file exists)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]
