"""Tokenizer training and preprocessing never replace existing files unless given --overwrite.

A refusal is one line on stderr, exit status 2, every existing file byte-identical afterwards.
"""

import json

import pytest

from megamamba.data import preprocess as prep
from megamamba.data.indexed import IndexedDataset
from megamamba.tokenizer import load_tokenizer
from megamamba.tokenizer import train as train_cli


def refusal(main, argv, capsys) -> str:
    """The stderr of `main(argv)`, which must exit with status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def file_bytes(folder) -> dict:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def train_tokenizer_argv(corpus, prefix, *flags) -> list:
    return ["--input", corpus, "--vocab-size", "330", "--output-prefix", str(prefix), *flags]


def preprocess_argv(corpus, prefix, *flags) -> list:
    return ["--input", str(corpus), "--tokenizer", "bytes", "--output-prefix", str(prefix), *flags]


def test_tokenizer_training_refuses_an_existing_model_and_leaves_it_as_it_was(corpus_jsonl, tmp_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "spm.model").write_bytes(b"someone's tokenizer")
    before = file_bytes(out)
    err = refusal(train_cli.main, train_tokenizer_argv(corpus_jsonl, out / "spm"), capsys)
    assert err == (
        f"tokenizer.train: error: --output-prefix {out}/spm: {out}/spm.model exists; choose another "
        "--output-prefix or pass --overwrite to replace it\n"
    )
    assert file_bytes(out) == before


def test_tokenizer_training_replaces_an_existing_model_under_overwrite(corpus_jsonl, tmp_path, capsys):
    (tmp_path / "spm.model").write_bytes(b"someone's tokenizer")
    train_cli.main(train_tokenizer_argv(corpus_jsonl, tmp_path / "spm", "--overwrite"))
    assert f"wrote {tmp_path}/spm.model" in capsys.readouterr().err
    assert load_tokenizer(str(tmp_path / "spm.model")).vocab_size == 330


def test_preprocessing_refuses_existing_datasets_and_leaves_them_as_they_were(corpus_jsonl, tmp_path, capsys):
    out = tmp_path / "data"
    prep.main(preprocess_argv(corpus_jsonl, out / "c", "--valid-fraction", "0.1"))
    before = file_bytes(out)
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "a few bytes"}) + "\n")
    capsys.readouterr()
    err = refusal(prep.main, preprocess_argv(small, out / "c", "--valid-fraction", "0.1"), capsys)
    files = ", ".join(
        f"{out}/c_{split}{suffix}" for split in ("train", "valid") for suffix in (".bin", ".idx", ".meta.json")
    )
    assert err == (
        f"preprocess: error: --output-prefix {out}/c: {files} exist; choose another --output-prefix or pass "
        "--overwrite to replace them\n"
    )
    assert file_bytes(out) == before


def test_preprocessing_replaces_an_existing_dataset_under_overwrite(corpus_jsonl, tmp_path, capsys):
    prep.main(preprocess_argv(corpus_jsonl, tmp_path / "c"))
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "a few bytes"}) + "\n")
    prep.main(preprocess_argv(small, tmp_path / "c", "--overwrite"))
    assert f"wrote {tmp_path}/c.bin and {tmp_path}/c.idx" in capsys.readouterr().err
    assert IndexedDataset(str(tmp_path / "c")).num_documents == 1
