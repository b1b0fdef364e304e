"""The documentation keeps up with launch/train.py: docs/flags.md names every flag, the commands the
README and docs/ show pass only flags train.py has (the README's pass every start-up check), and
their links lead to files that exist."""

import argparse
import io
import re
import shlex

import pytest

from megamamba.data.preprocess import preprocess
from train_entry import ROOT, load_train_script

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class _Parser(Exception):
    """Carries the parser out of parse_args before it parses."""


def _train_options() -> set:
    def capture(self, args=None, namespace=None):
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        load_train_script().parse_args([])
    except _Parser as e:
        parser = e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


def _train_commands(text: str) -> list:
    """(launcher words, train.py arguments) of each `launch/train.py` command in the bash blocks of `text`."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if "launch/train.py" in words:
                at = words.index("launch/train.py")
                commands.append((words[:at], words[at + 1 :]))
    return commands


def test_docs_flags_md_names_every_flag_of_train_py():
    table = (ROOT / "docs/flags.md").read_text()
    missing = sorted(o for o in _train_options() if f"`{o}`" not in table)
    assert not missing, f"docs/flags.md lacks {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_train_commands_shown_in_the_docs_pass_only_flags_train_py_has(doc):
    options = _train_options()
    for _, words in _train_commands(doc.read_text()):
        unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in options]
        assert not unknown, f"{doc.name}: launch/train.py {' '.join(words)}: unknown {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_in_the_docs_lead_to_files_that_exist(doc):
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text())
    missing = [link for link in links if not (doc.parent / link).exists()]
    assert not missing, f"{doc.name} links to missing {missing}"


def test_the_readmes_train_commands_pass_every_start_up_check_at_their_gpu_count(tmp_path, monkeypatch):
    """Their tokenizer, data and save directory replaced by a small bytes dataset and a scratch folder."""
    text = tmp_path / "text.jsonl"
    text.write_text("".join(f'{{"text": "document {i}: {"Mamba " * 50}"}}\n' for i in range(40)))
    train, valid = preprocess(
        [str(text)], "bytes", str(tmp_path / "d"), valid_fraction=0.25, progress_stream=io.StringIO()
    )
    monkeypatch.chdir(ROOT)
    script = load_train_script()
    commands = _train_commands((ROOT / "README.md").read_text())
    assert commands, "the README shows no launch/train.py command"
    for launcher, words in commands:
        gpus = int(launcher[launcher.index("--num_gpus") + 1])
        args = script.parse_args(words)
        args.tokenizer, args.data, args.valid_data, args.save = "bytes", [train], [valid], str(tmp_path / "save")
        assert script.prepare(args, gpus).layout.world_size == gpus
