"""The corpus dump and tokenizer-training commands produce what the preprocessing command consumes."""

import json

from megamamba.data import corpus_dump
from megamamba.data.corpus import python_docs
from megamamba.data.documents import input_files, iter_documents
from megamamba.tokenizer import load_tokenizer
from megamamba.tokenizer import train as train_cli


def test_corpus_dump_writes_the_built_in_corpus_as_jsonl(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    corpus_dump.main(["--output", str(path)])
    docs = python_docs()
    assert f"wrote {len(docs)} documents" in capsys.readouterr().err
    assert [text for text, _ in iter_documents(input_files([str(path)]))] == docs


def test_tokenizer_command_trains_a_loadable_model(corpus_jsonl, tmp_path, capsys):
    prefix = tmp_path / "tok" / "spm"
    train_cli.main(
        ["--input", corpus_jsonl, "--vocab-size", "330", "--model-type", "unigram", "--output-prefix", str(prefix)]
    )
    assert f"wrote {prefix}.model" in capsys.readouterr().err
    tok = load_tokenizer(f"{prefix}.model")
    text = json.loads(open(corpus_jsonl).readline())["text"]
    assert tok.vocab_size == 330 and tok.decode(tok.encode(text)) == text
