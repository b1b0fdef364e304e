"""Preprocessing: deterministic Megatron-layout files, the split, inputs, progress and clear failures."""

import io
import json
import re
import struct

import numpy as np
import pytest

from data_fixtures import TEXTS, write_dataset
from megamamba.data import preprocess as prep
from megamamba.data.indexed import DatasetError, IndexedDataset
from megamamba.tokenizer import load_tokenizer


def run(inputs, prefix, workers=1, valid_fraction=0.0, tokenizer="bytes", **kw):
    return prep.preprocess(
        inputs,
        tokenizer,
        str(prefix),
        workers=workers,
        valid_fraction=valid_fraction,
        progress_stream=io.StringIO(),
        **kw,
    )


def file_bytes(prefix):
    return {s: open(prefix + s, "rb").read() for s in (".bin", ".idx")}


def test_preprocessing_twice_gives_identical_files_whatever_the_workers(corpus_jsonl, tmp_path):
    first = run([corpus_jsonl], tmp_path / "a" / "c", workers=1, valid_fraction=0.1)
    second = run([corpus_jsonl], tmp_path / "b" / "c", workers=2, valid_fraction=0.1)
    for p, q in zip(first, second):
        assert file_bytes(p) == file_bytes(q), f"{p} and {q} differ"


def test_documents_are_stored_with_an_end_of_document_token(corpus_jsonl, tmp_path):
    (prefix,) = run([corpus_jsonl], tmp_path / "c")
    tok = load_tokenizer("bytes")
    texts = [json.loads(line)["text"] for line in open(corpus_jsonl)]
    texts = [t for t in texts if t]  # empty documents are skipped
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert ds.num_documents == len(texts)
    for d in (0, 1, 2, len(texts) - 1):
        assert ds.document(d).tolist() == tok.encode(texts[d]) + [tok.eod]


def test_index_has_megatrons_byte_layout(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), [[5, 6, 7], [8], [9, 10]])
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, doc_entries = struct.unpack("<QBQQ", idx[9:34])
    assert (version, code, sequences, doc_entries) == (1, 8, 3, 4)  # 8: uint16
    lengths = np.frombuffer(idx, np.int32, 3, 34)
    pointers = np.frombuffer(idx, np.int64, 3, 34 + 12)
    documents = np.frombuffer(idx, np.int64, 4, 34 + 36)
    assert lengths.tolist() == [3, 1, 2] and pointers.tolist() == [0, 6, 8] and documents.tolist() == [0, 1, 2, 3]
    assert len(idx) == 34 + 36 + 32
    assert np.fromfile(prefix + ".bin", np.uint16).tolist() == [5, 6, 7, 8, 9, 10]


def test_large_vocabularies_are_stored_as_int32(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), [[70000, 1]], dtype=np.int32)
    ds = IndexedDataset(prefix, vocab_size=70001)
    assert ds.dtype == np.int32 and ds.document(0).tolist() == [70000, 1]
    assert prep.token_dtype(65499) == np.uint16 and prep.token_dtype(65500) == np.int32


def test_validation_split_holds_the_requested_fraction_and_no_document_twice(corpus_jsonl, tmp_path):
    train, valid = run([corpus_jsonl], tmp_path / "c", valid_fraction=0.1)
    ds_train, ds_valid = IndexedDataset(train), IndexedDataset(valid)
    kept = 200  # 240 documents, 40 of them empty
    assert ds_train.num_documents + ds_valid.num_documents == kept
    assert abs(ds_valid.num_documents - 0.1 * kept) <= 2, ds_valid.num_documents
    docs = {d.tobytes() for ds in (ds_train, ds_valid) for d in map(ds.document, range(ds.num_documents))}
    assert len(docs) == kept  # every document (all distinct here) is in exactly one split


def test_folders_and_text_files_are_read_in_sorted_order(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "sub" / "c.txt").write_text("third")
    (folder / "ignored.md").write_text("not a text input")
    (prefix,) = run([str(folder)], tmp_path / "out")
    ds = IndexedDataset(prefix)
    assert [bytes(ds.document(d)[:-1].astype(np.uint8)).decode() for d in range(3)] == ["first", "second", "third"]
    assert ds.num_documents == 3


def test_json_key_selects_the_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"content": "abc", "text": "zzz"}) + "\n")
    (prefix,) = run([str(path)], tmp_path / "out", json_key="content")
    assert IndexedDataset(prefix).document(0).tolist() == [97, 98, 99, 256]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"body": "x"}', r"d.jsonl:2: no key 'text' \(choose it with --json-key\)"),
        ("not json", "d.jsonl:2: not a JSON object"),
        ('{"text": 3}', "d.jsonl:2: 'text' holds int, not text"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        run([str(path)], tmp_path / "out")
    assert not list(tmp_path.glob("out*")), "a failed run left files behind"


def test_empty_input_fails_clearly(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"text": ""}\n\n')
    with pytest.raises(DatasetError, match=r"out: no documents \(0 kept, 2 empty skipped, from 1 input files\)"):
        run([str(path)], tmp_path / "out")


def test_missing_input_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt'?: no such file or folder"):
        run([str(tmp_path / "nope.txt")], tmp_path / "out")


def test_progress_line_shows_rate_and_eta(corpus_jsonl, tmp_path):
    stream = io.StringIO()
    prep.preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=stream)
    last = stream.getvalue().strip().split("\r")[-1]
    assert last.startswith("preprocess: 100.0% | 240 docs |") and "MB/s" in last and "ETA 0:00:00" in last


def test_command_line_writes_both_splits(corpus_jsonl, tmp_path, capsys):
    prep.main(
        [
            "--input",
            corpus_jsonl,
            "--tokenizer",
            "bytes",
            "--output-prefix",
            str(tmp_path / "c"),
            "--workers",
            "2",
            "--valid-fraction",
            "0.05",
        ]
    )
    err = capsys.readouterr().err
    assert f"wrote {tmp_path}/c_train.bin" in err and f"wrote {tmp_path}/c_valid.bin" in err
    assert IndexedDataset(str(tmp_path / "c_valid")).num_documents >= 1


def test_command_line_failure_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        prep.main(["--input", str(tmp_path / "x"), "--tokenizer", "bytes", "--output-prefix", str(tmp_path / "c")])
    assert e.value.code == 2
    assert re.fullmatch(r"preprocess: error: .*no such file or folder\n", capsys.readouterr().err)


def test_sentencepiece_dataset_round_trips(tmp_path):
    from megamamba.tokenizer import train_sentencepiece

    model = train_sentencepiece([t * 5 for t in TEXTS] * 4, str(tmp_path / "spm"), 330)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS if t))
    (prefix,) = run([str(path)], tmp_path / "out", tokenizer=model)
    tok = load_tokenizer(model)
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert [tok.decode(ds.document(d)[:-1]) for d in range(ds.num_documents)] == [t for t in TEXTS if t]
