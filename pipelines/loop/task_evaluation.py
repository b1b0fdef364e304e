"""lm-eval tasks on the run's own checkpoints while it trains (`--eval-tasks`).

At each `--eval-interval` step, once that step's checkpoint is saved, global rank 0 starts `python -m
megamamba.evaluate` on it in a child process (the path users evaluate by: docs/clients.md) and training goes
on. When a child ends its result is one console line; the run waits for the last ones before it exits. A child
that fails is a warning naming its log, never the end of the run. lm-eval is optional (`pip install -e
.[eval]`): start-up refuses `--eval-tasks` without it, or with a task it does not know.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from typing import NamedTuple, Optional

from megamamba.errors import MegamambaError
from megamamba.evaluate import lm_eval_package, results_path, task_names

log = logging.getLogger(__name__)
WROTE = "evaluate: wrote "  # the line megamamba.evaluate ends with
# the launcher's rendezvous variables: a child that inherited them would join (or clash with) the run's group
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TaskEvaluationError(MegamambaError):
    """--eval-tasks settings that cannot run; the message says how to fix them."""


def add_task_evaluation_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's flags for lm-eval tasks during training (docs/flags.md)."""
    p = parser.add_argument_group("lm-eval tasks during training")
    p.add_argument(
        "--eval-tasks", default=None, help="lm-eval tasks, comma-separated, on each --eval-interval checkpoint"
    )
    p.add_argument("--eval-tasks-include-path", default=None, help="a folder of task YAMLs of your own (held-out sets)")
    p.add_argument("--eval-tasks-limit", type=int, default=None, help="at most N examples per task")
    p.add_argument(
        "--eval-tasks-device", default="cpu", help="device of the evaluation (default cpu: none of training's memory)"
    )


class TaskSettings(NamedTuple):
    tasks: str
    include_path: Optional[str]
    limit: Optional[int]
    device: str


def task_settings(args: argparse.Namespace) -> Optional[TaskSettings]:
    """The --eval-tasks settings, checked (no process group needed), or None without --eval-tasks."""
    if args.eval_tasks is None:
        return None
    if not args.save:
        raise TaskEvaluationError("--eval-tasks evaluates the run's checkpoints: give --save DIR")
    if not (args.eval_interval > 0 and args.save_interval > 0 and args.eval_interval % args.save_interval == 0):
        raise TaskEvaluationError(
            f"--eval-interval {args.eval_interval} with --eval-tasks must be a positive multiple of --save-interval "
            f"{args.save_interval}: each evaluation reads the checkpoint of its step"
        )
    if args.eval_tasks_limit is not None and args.eval_tasks_limit < 1:
        raise TaskEvaluationError(f"--eval-tasks-limit {args.eval_tasks_limit}: must be at least 1")
    try:
        task_names(args.eval_tasks, lm_eval_package().tasks.TaskManager(include_path=args.eval_tasks_include_path))
    except MegamambaError as e:
        raise TaskEvaluationError(f"--eval-tasks: {e}") from None
    return TaskSettings(args.eval_tasks, args.eval_tasks_include_path, args.eval_tasks_limit, args.eval_tasks_device)


def _summary(results_file: str) -> str:
    """Each task's metrics from lm-eval's results file, e.g. `hellaswag acc,none 0.3100`."""
    with open(results_file) as f:
        results = json.load(f)["results"]
    parts = []
    for task, metrics in results.items():
        values = [f"{k} {v:.4g}" for k, v in metrics.items() if "," in k and "stderr" not in k]  # metric,filter
        parts.append(f"{task} {', '.join(values)}")
    return "; ".join(parts)


class TaskEvaluations:
    """The evaluation children of global rank 0 (on other ranks it does nothing)."""

    def __init__(self, settings: Optional[TaskSettings], save: Optional[str], rank: int):
        self.settings, self.save = settings, save
        self.running: dict = {}  # tag -> (child, its log path)
        self.rank = rank

    def start(self, tag: str) -> None:
        """Evaluate the checkpoint `tag` of the save directory in a child process."""
        s, save = self.settings, self.save
        if s is None or save is None or self.rank != 0:
            return
        log_path = os.path.splitext(results_path(os.path.join(save, tag), time.time()))[0] + ".log"  # beside them
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        command = [sys.executable, "-m", "megamamba.evaluate", "--load", save, "--tag", tag]
        command += ["--tasks", s.tasks, "--device", s.device]
        if s.include_path:
            command += ["--include-path", s.include_path]
        if s.limit:
            command += ["--limit", str(s.limit)]
        with open(log_path, "w") as out:
            env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
            self.running[tag] = (subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env), log_path)
        log.info(f"evaluating {tag} on {s.tasks} in the background (log: {log_path})")

    def poll(self, wait: bool = False) -> None:
        """One line per child that has ended (waiting for each with wait=True)."""
        for tag, (child, log_path) in list(self.running.items()):
            if wait and child.poll() is None:
                log.info(f"waiting for the evaluation of {tag} to finish (log: {log_path})")
                child.wait()
            if child.poll() is None:
                continue
            del self.running[tag]
            with open(log_path) as f:
                lines = f.read().splitlines()
            wrote = [line[len(WROTE) :] for line in lines if line.startswith(WROTE)]
            if child.returncode == 0 and wrote:
                log.info(f"evaluation of {tag}: {_summary(wrote[-1])} ({wrote[-1]})")
            else:
                errors = [line for line in lines if line.startswith("evaluate: error:") or "Error:" in line]
                last = (errors or lines or ["no output"])[-1]
                log.warning(f"evaluation of {tag} failed (exit {child.returncode}): {last}; its log: {log_path}")

    def stop(self) -> None:
        """The run ends on an error or an interruption: children still running are stopped, one line each."""
        for tag, (child, log_path) in self.running.items():
            if child.poll() is None:
                child.terminate()
                child.wait()
                log.warning(f"the evaluation of {tag} was stopped with the run; its log: {log_path}")
        self.running.clear()
