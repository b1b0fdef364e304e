"""Invalid UTF-8 is handled alike for JSONL, .txt and folders: refused with file, line and byte
offset, or replaced with U+FFFD only under --replace-invalid-utf8, which says so."""

import pytest

from megamamba.data import preprocess as prep
from megamamba.data.documents import input_files, iter_documents
from megamamba.data.indexed import IndexedDataset
from megamamba.tokenizer import load_tokenizer

BAD = b"caf\xe9 au lait"  # Latin-1, not UTF-8: byte 3 of the text is invalid


@pytest.fixture
def inputs(tmp_path):
    """{kind: (path, expected location)} with the invalid byte on the text's second line."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "' + BAD + b'"}\n')
    txt = tmp_path / "doc.txt"
    txt.write_bytes(b"first line\n" + BAD + b"\n")
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"good text\n")
    (folder / "sub" / "b.txt").write_bytes(b"first line\n" + BAD + b"\n")
    return {
        "jsonl": (jsonl, f"{jsonl}:2: invalid UTF-8 at byte offset {17 + 10 + 3}"),
        "txt": (txt, f"{txt}:2: invalid UTF-8 at byte offset {11 + 3}"),
        "folder": (folder, f"{folder / 'sub' / 'b.txt'}:2: invalid UTF-8 at byte offset {11 + 3}"),
    }


@pytest.mark.parametrize("kind", ["jsonl", "txt", "folder"])
def test_invalid_utf8_is_refused_with_file_line_and_offset(tmp_path, inputs, capsys, kind):
    path, where = inputs[kind]
    with pytest.raises(SystemExit) as e:
        prep.main(["--input", str(path), "--tokenizer", "bytes", "--output-prefix", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == f"preprocess: error: {where} (invalid continuation byte); fix the input, or pass "
        "--replace-invalid-utf8 to replace invalid bytes with U+FFFD\n"
    )
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("kind", ["jsonl", "txt", "folder"])
def test_invalid_utf8_is_replaced_under_the_flag_which_says_so(tmp_path, inputs, capsys, kind):
    path, where = inputs[kind]
    prep.main(
        [
            "--input",
            str(path),
            "--tokenizer",
            "bytes",
            "--output-prefix",
            str(tmp_path / "out"),
            "--replace-invalid-utf8",
        ]
    )
    err = capsys.readouterr().err
    assert f"warning: {where} (invalid continuation byte): replaced with U+FFFD (--replace-invalid-utf8)" in err
    texts = [text for text, _ in iter_documents(input_files([str(path)]), replace_invalid_utf8=True)]
    assert any("caf\ufffd au lait" in t for t in texts)
    dataset = IndexedDataset(str(tmp_path / "out"))
    tok = load_tokenizer("bytes")
    decoded = [tok.decode(dataset.document(d)[:-1]) for d in range(dataset.num_documents)]
    assert decoded == [t for t in texts if t]


def test_tokenizer_training_refuses_invalid_utf8_in_one_line_without_writing_a_model(tmp_path, inputs, capsys):
    from megamamba.tokenizer import train as train_cli

    path, where = inputs["jsonl"]
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--input", str(path), "--vocab-size", "300", "--output-prefix", str(tmp_path / "spm")])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"tokenizer.train: error: {where} (invalid continuation byte); ")
    assert not (tmp_path / "spm.model").exists()
