"""A stand-in for the wandb package: records init, log and finish calls as JSON lines in $FAKE_WANDB_CALLS."""

import json
import os


def _record(entry: dict) -> None:
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(json.dumps(entry) + "\n")


class Run:
    def log(self, data, step=None):
        _record({"call": "log", "data": data, "step": step})

    def finish(self):
        _record({"call": "finish"})


def init(**kwargs):
    _record({"call": "init", "kwargs": kwargs})
    return Run()
