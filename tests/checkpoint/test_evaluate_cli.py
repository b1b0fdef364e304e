"""`python -m megamamba.evaluate`, run in-process on a tiny checkpoint and a held-out task of our own.

lm-eval's own tasks fetch their datasets from the Hugging Face Hub, which the tests cannot reach: the
task here is a YAML in the test's folder reading a local JSON-lines file (`--include-path`), scored by
lm-eval's rolling loglikelihood. lm-eval indexes its 14,000 task YAMLs on every `TaskManager` (4 s
here): the module builds one per include path and hands it out again. Skipped where lm-eval is not
installed (`pip install -e .[eval]`; CI installs it).
"""

import contextlib
import io
import json
import math
import os
import shutil
import sys

import pytest
import torch

from checkpoint_fixtures import perturbed_model, snapshot, tiny
from eval_tasks import held_out_task
from megamamba.checkpoint import save_training_checkpoint
from megamamba.evaluate import main
from megamamba.tokenizer import load_tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e .[eval]")
lm_eval_tasks = pytest.importorskip("lm_eval.tasks")

DOCUMENTS = ("def f(x):\n    return x + 1\n", "naïve café", "x = 1\ny = 2\n")


@pytest.fixture(scope="module")
def task_managers():
    """lm-eval's TaskManager, built once per include path for the whole module."""
    built = {}
    real = lm_eval_tasks.TaskManager

    def shared(include_path=None):
        if include_path not in built:
            built[include_path] = real(include_path=include_path)
        return built[include_path]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval_tasks, "TaskManager", shared)
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory, task_managers):
    """(save directory with the checkpoint step_000003, task folder, our model, our tokenizer)."""
    root = tmp_path_factory.mktemp("evaluate")
    tok = load_tokenizer("bytes")
    model = perturbed_model(tiny("Mamba2", vocab_size=tok.vocab_size, pad_vocab_size_multiple=1), 5)
    save_training_checkpoint(str(root / "save"), 3, model, torch.optim.AdamW(model.parameters()), tokenizer=tok)
    tasks = held_out_task(root / "tasks", DOCUMENTS, root / "datasets")
    return str(root / "save"), str(tasks), model.eval(), tok


def evaluate(*argv) -> str:
    """stdout of a successful run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([str(a) for a in argv])
    return out.getvalue()


def refused(argv) -> str:
    """The one stderr line of a refusal with exit status 2."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        main([str(a) for a in argv])
    assert e.value.code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def our_bits_per_byte(model, tok, documents) -> float:
    """-sum(log2 p(document | end-of-document token)) / sum(UTF-8 bytes), as lm-eval aggregates it."""
    nats = 0.0
    for doc in documents:
        ids = [tok.eod] + tok.encode(doc)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1, : model.config.vocab_size].double(), dim=-1)
        nats -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return nats / sum(len(d.encode()) for d in documents) / math.log(2)


@pytest.mark.slow  # lm-eval's task index (4 s), transformers' model and lm-eval's run
def test_evaluate_writes_lm_eval_s_results_beside_the_checkpoint(run):
    save, tasks, model, tok = run
    out = evaluate("--load", save, "--tasks", "held_out", "--include-path", tasks, "--limit", "2")
    (written,) = os.listdir(os.path.join(save, "eval"))
    assert written.startswith("step_000003-") and written.endswith("Z.json")
    assert out.splitlines()[-1] == f"evaluate: wrote {os.path.join(save, 'eval', written)}"
    assert "|held_out|" in out.replace(" ", "")
    with open(os.path.join(save, "eval", written)) as f:
        results = json.load(f)
    assert results["megamamba"] == {"checkpoint": os.path.join(save, "step_000003"), "lm_eval": lm_eval.__version__}
    held_out = results["results"]["held_out"]
    assert held_out["sample_len"] == 2
    assert held_out["bits_per_byte,none"] == pytest.approx(our_bits_per_byte(model, tok, DOCUMENTS[:2]), rel=1e-6)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--load", "{root}/nowhere"], "evaluate: error: --load {root}/nowhere: no such directory"),
        (
            ["--load", "{save}", "--tag", "step_000009"],
            "evaluate: error: --tag step_000009: {save} holds no checkpoint step_000009; name one of its step_* "
            "folders",
        ),
        pytest.param(
            ["--load", "{save}", "--tasks", "held_out,no_such_task"],
            "evaluate: error: --tasks: lm-eval knows no task no_such_task (`lm-eval ls tasks` lists them; tasks of "
            "your own: --include-path DIR)",
            marks=pytest.mark.slow,  # lm-eval's task index, unless the slow test above built it
        ),
        (
            ["--load", "{save}", "--output", "{save}/latest"],
            "evaluate: error: --output {save}/latest: exists; results are never written over a file",
        ),
        (["--load", "{save}", "--batch-size", "0"], "evaluate: error: --batch-size 0: must be at least 1"),
    ],
    ids=["no checkpoint", "no such tag", "unknown task", "existing output", "batch size 0"],
)
def test_a_refusal_is_one_line_and_changes_nothing(run, argv, message):
    save, tasks, _, _ = run
    root = os.path.dirname(save)
    before = snapshot(root)
    argv = [a.format(root=root, save=save) for a in argv]
    assert refused(argv + ["--include-path", tasks] + ([] if "--tasks" in argv else ["--tasks", "held_out"])) == (
        message.format(root=root, save=save)
    )
    assert snapshot(root) == before


@pytest.mark.slow  # the checksums are read by the export, after lm-eval's task index (4 s) has checked --tasks
def test_a_checkpoint_whose_checksum_differs_is_refused_before_evaluating(run, tmp_path):
    save, tasks, _, _ = run
    damaged = tmp_path / "save"
    shutil.copytree(save, damaged, ignore=shutil.ignore_patterns("eval"))
    weights = damaged / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    before = snapshot(str(tmp_path))
    assert refused(["--load", damaged, "--tasks", "held_out", "--include-path", tasks]) == (
        f"evaluate: error: {weights}: sha256 differs from manifest.json: the file is corrupt; resume from another "
        "checkpoint"
    )
    assert snapshot(str(tmp_path)) == before


def test_without_lm_eval_evaluate_says_how_to_install_it(run, monkeypatch):
    save, tasks, _, _ = run
    before = snapshot(save)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert refused(["--load", save, "--tasks", "held_out"]) == (
        "evaluate: error: lm-eval with its transformers backend is not installed (no module lm_eval); install it "
        "with: pip install -e .[eval]"
    )
    assert snapshot(save) == before
