"""Evaluate a checkpoint with lm-evaluation-harness, on the export users would evaluate.

    python -m megamamba.evaluate --load DIR [--tag step_000100] --tasks hellaswag,wikitext [--limit N]
                                 [--batch-size N] [--device cpu] [--include-path TASK_DIR] [--output FILE]

DIR is a checkpoint, a save directory (the checkpoint its `latest` names, or --tag) or a model folder.
It is exported to transformers' format in a temporary folder (`megamamba.checkpoint.convert.export_hf`,
which verifies a checkpoint's sizes and checksums) and evaluated by lm-eval's transformers backend
through `ExportLM` (megamamba/lm_eval_model.py), which scores the ids training feeds the model.
lm-eval's results, with the checkpoint's path, go to `eval/<tag>-<UTC time>.json` in the folder
holding the checkpoint, or to --output; an existing file is never overwritten. --include-path adds
task YAMLs of your own (a held-out set as a local JSON dataset). lm-eval is optional:
`pip install -e .[eval]`. Refusals are one line, exit status 2.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional

import torch
from safetensors import SafetensorError

from megamamba.checkpoint.convert import export_hf
from megamamba.checkpoint.files import write_bytes
from megamamba.checkpoint.store import resolve_model_folder
from megamamba.errors import MegamambaError
from megamamba.generate import check_device
from megamamba.tokenizer import find_tokenizer

RESULTS_FOLDER = "eval"


class EvaluateError(MegamambaError):
    """Arguments or an environment with which no evaluation can run; the message says how to fix it."""


def lm_eval_package():
    """The lm_eval package with its transformers backend; EvaluateError saying how to install it when missing."""
    try:
        import lm_eval
        import lm_eval.models.huggingface
        import lm_eval.tasks
    except ImportError as e:
        raise EvaluateError(
            f"lm-eval with its transformers backend is not installed (no module {e.name}); install it with: "
            "pip install -e .[eval]"
        ) from None
    return lm_eval


def checkpoint_folder(load: str, tag: Optional[str] = None) -> str:
    """The folder --load (and --tag) name: a complete checkpoint (the export reads its checksums) or a model
    folder."""
    if tag is not None:
        if not os.path.isdir(os.path.join(load, tag)):
            raise EvaluateError(f"--tag {tag}: {load} holds no checkpoint {tag}; name one of its step_* folders")
        load = os.path.join(load, tag)
    return resolve_model_folder(load, flag="--load", hashes=False)[0]


def results_path(checkpoint: str, started: float) -> str:
    """`eval/<checkpoint folder name>-<UTC time>.json` in the folder holding the checkpoint."""
    folder = os.path.abspath(checkpoint)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    return os.path.join(os.path.dirname(folder), RESULTS_FOLDER, f"{os.path.basename(folder)}-{stamp}.json")


def task_names(tasks: str, task_manager) -> list:
    """The names of the tasks the comma-separated --tasks names or matches (glob patterns), each known to lm-eval."""
    given = [t.strip() for t in tasks.split(",") if t.strip()]
    if not given:
        raise EvaluateError(f"--tasks {tasks!r}: names no task; e.g. --tasks hellaswag,wikitext")
    matched = {t: task_manager.match_tasks([t]) for t in given}
    unknown = [t for t, names in matched.items() if not names]
    if unknown:
        raise EvaluateError(
            f"--tasks: lm-eval knows no task {', '.join(unknown)} (`lm-eval ls tasks` lists them; "
            "tasks of your own: --include-path DIR)"
        )
    return list(dict.fromkeys(name for names in matched.values() for name in names))


def evaluate(
    checkpoint: str, tasks: list, task_manager, device: str, batch_size: int, limit: Optional[int] = None
) -> dict:
    """lm-eval's results for `checkpoint` exported into a temporary folder, with the checkpoint's path added."""
    lm_eval = lm_eval_package()
    from megamamba.lm_eval_model import ExportLM

    with tempfile.TemporaryDirectory(prefix="megamamba-evaluate-") as tmp:
        exported = export_hf(checkpoint, os.path.join(tmp, "model"))
        model = ExportLM(exported, device=device, batch_size=batch_size)
        try:
            results = lm_eval.simple_evaluate(
                model=model, tasks=tasks, limit=limit, task_manager=task_manager, log_samples=False
            )
        except ConnectionError as e:
            raise EvaluateError(
                f"a task's dataset could not be fetched ({e}): lm-eval downloads task datasets from the Hugging "
                "Face Hub; run where it is reachable, or fetch them once there and set HF_DATASETS_OFFLINE=1"
            ) from None
    results["megamamba"] = {"checkpoint": os.path.abspath(checkpoint), "lm_eval": lm_eval.__version__}
    return results


def write_results(results: dict, path: str) -> None:
    """lm-eval's results as JSON at `path`, created (never overwritten) and fsynced."""
    from lm_eval.utils import handle_non_serializable

    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        write_bytes(path, text.encode())
    except FileExistsError:
        raise EvaluateError(f"--output {path}: exists; results are never written over a file") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint, save directory (its latest, or --tag) or model folder")
    p.add_argument("--tag", default=None, help="checkpoint in the save directory, e.g. step_000100")
    p.add_argument("--tasks", required=True, help="lm-eval task names or patterns, comma-separated")
    p.add_argument("--limit", type=int, default=None, help="at most N examples per task (a quick check)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per forward pass (prompts padded on the left)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device of the model")
    p.add_argument("--include-path", default=None, help="a folder of task YAMLs of your own, beside lm-eval's")
    p.add_argument(
        "--output", default=None, help="results JSON (default: eval/<tag>-<UTC time>.json beside the checkpoint)"
    )
    return p.parse_args(argv)


def refuse(message) -> None:
    """One line on stderr, exit status 2."""
    print(f"evaluate: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def run(args: argparse.Namespace) -> tuple:
    """(lm-eval's results, the path they were written to) for the parsed command line."""
    started = time.time()
    try:
        check_device(args.device)
    except ValueError as e:
        raise EvaluateError(e) from None
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise EvaluateError(f"{flag} {value}: must be at least 1")
    checkpoint = checkpoint_folder(args.load, args.tag)
    if find_tokenizer(checkpoint) is None:
        raise EvaluateError(f"{checkpoint}: holds no tokenizer files, and lm-eval needs the tokenizer")
    output = args.output or results_path(checkpoint, started)
    if os.path.exists(output):
        raise EvaluateError(f"--output {output}: exists; results are never written over a file")
    task_manager = lm_eval_package().tasks.TaskManager(include_path=args.include_path)
    tasks = task_names(args.tasks, task_manager)
    results = evaluate(checkpoint, tasks, task_manager, args.device, args.batch_size, args.limit)
    write_results(results, output)
    return results, output


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        results, output = run(args)
    except (MegamambaError, SafetensorError) as e:
        refuse(e)
    from lm_eval.utils import make_table

    print(make_table(results))
    print(f"evaluate: wrote {output}")


if __name__ == "__main__":
    main()
