"""Writers of a step's metrics record (`megamamba.observe.metrics`): JSON lines, TensorBoard, CSV files, wandb.

Each takes the record as `write(record)` (`step` first, None values already left out) and is
closed once. The CSV and wandb writers keep the layout and calls of DeepSpeed's csv_monitor and
wandb monitors, with our metric names and `step` the optimizer step (DeepSpeed's engine logs its
own names against the sample count).
"""

import csv
import json
import os


def _metrics(record: dict) -> dict:
    return {name: value for name, value in record.items() if name != "step"}


class JsonlMonitor:
    """One JSON object per record, appended to `path`."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardMonitor:
    """One scalar per metric name, at global step `step`."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        for name, value in _metrics(record).items():
            self._writer.add_scalar(name, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CsvMonitor:
    """`<directory>/<name>.csv` per metric: a `step,<name>` header, then one `step,value` row per record.

    A resumed run appends to the files of the run before it; the header is written once per file.
    """

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self._directory = directory

    def write(self, record: dict) -> None:
        for name, value in _metrics(record).items():
            path = os.path.join(self._directory, f"{name}.csv")
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                rows = csv.writer(f)
                if new:
                    rows.writerow(["step", name])
                rows.writerow([record["step"], value])

    def close(self) -> None:
        pass


class WandbMonitor:
    """One wandb run (`init_kwargs` go to wandb.init); each record is one `log(metrics, step=step)`."""

    def __init__(self, init_kwargs: dict):
        import wandb

        self._run = wandb.init(**init_kwargs)

    def write(self, record: dict) -> None:
        self._run.log(_metrics(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()
