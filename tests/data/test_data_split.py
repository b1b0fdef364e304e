"""--split carves train, validation and test parts from one --data blend: disjoint, proportional, deterministic."""

import os
import re
from fractions import Fraction

import numpy as np
import pytest

from data_fixtures import EOD, labelled_documents, write_dataset
from distributed import run_ranks
from megamamba import MambaConfig
from megamamba.data.indexed import IndexedDataset
from megamamba.data.split import document_ranges, parse_split, split_blend
from megamamba.data.training_data import training_data
from train_entry import ROOT, load_train_script, read_metrics, run_train

TINY = MambaConfig.from_json(ROOT / "launch/models/tiny-mamba2.json")  # vocab 257: the byte tokenizer's
SEQ, BATCH = 16, 4


@pytest.fixture
def blend(tmp_path):
    """Two datasets whose documents' tokens are the document's label: a 1..200, b 201..250 (then EOD)."""
    a = write_dataset(str(tmp_path / "a"), labelled_documents(200, seed=1, first_label=1, min_len=2, max_len=12))
    b = write_dataset(str(tmp_path / "b"), labelled_documents(50, seed=2, first_label=201, min_len=2, max_len=12))
    return ["3", a, "1", b]


def labels(dataset) -> set:
    """The document labels of a dataset or a part of one."""
    tokens = dataset.tokens[dataset.offsets[0] : dataset.offsets[-1]]
    return set(np.unique(tokens[tokens != EOD]).tolist())


def test_proportions_are_normalised_and_missing_parts_are_empty():
    assert parse_split("969,30,1") == (Fraction(969, 1000), Fraction(30, 1000), Fraction(1, 1000))
    assert parse_split("90, 10") == (Fraction(9, 10), Fraction(1, 10), 0)
    assert parse_split("1") == (1, 0, 0)


@pytest.mark.parametrize(
    "text, words",
    [
        ("90,x,1", "--split '90,x,1': 'x' is not a number"),
        ("90,5,3,2", "--split '90,5,3,2': 4 proportions; at most 3"),
        ("90,-5,5", "--split '90,-5,5': proportion '-5' is negative"),
        ("0,50,50", "--split '0,50,50': the training part is empty"),
        ("", "--split '': '' is not a number"),
    ],
)
def test_malformed_splits_are_one_line_refusals(text, words):
    with pytest.raises(ValueError) as e:
        parse_split(text)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


@pytest.mark.parametrize("n", [1, 7, 100, 1001, 123457])
def test_document_ranges_are_disjoint_cover_every_document_and_follow_the_proportions(n):
    proportions = parse_split("969,30,1")
    ranges = document_ranges(n, proportions)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(stop == first for (_, stop), (first, _) in zip(ranges, ranges[1:]))
    for (first, stop), proportion in zip(ranges, proportions):
        assert abs((stop - first) - n * proportion) <= 1, (n, ranges)


def test_every_dataset_of_the_blend_is_split_into_disjoint_parts(blend):
    datasets = [IndexedDataset(p) for p in blend[1::2]]
    parts = split_blend(datasets, "80,15,5")
    for d, dataset in enumerate(datasets):
        train, valid, test = parts.train[d], parts.valid[d], parts.test[d]
        assert train.num_documents + valid.num_documents + test.num_documents == dataset.num_documents
        for part, proportion in ((train, 0.8), (valid, 0.15), (test, 0.05)):
            assert abs(part.num_documents - proportion * dataset.num_documents) <= 1, (part.prefix, proportion)
        assert (
            not labels(train) & labels(valid) and not labels(valid) & labels(test) and not labels(train) & labels(test)
        )
        assert labels(train) | labels(valid) | labels(test) == labels(dataset)
        assert train.num_tokens + valid.num_tokens + test.num_tokens == dataset.num_tokens


def test_validation_batches_come_from_the_validation_part_only(blend):
    data = training_data(TINY, "bytes", blend, [], SEQ, BATCH, seed=3, split="80,15,5")
    valid_labels = set().union(*(labels(p.dataset) for p in data.valid.packers))
    train_labels = set().union(*(labels(p.dataset) for p in data.train.packers))
    seen = {}
    for name, batches in (("valid", data.valid), ("train", data.train)):
        inputs, targets, _ = batches.rows_at(0, 5 * BATCH)
        seen[name] = set(np.unique(np.concatenate([inputs.numpy(), targets.numpy()]))) - {EOD}
    assert seen["valid"] and seen["valid"] <= valid_labels
    assert seen["train"] and seen["train"] <= train_labels and not seen["train"] & valid_labels


def test_the_same_split_gives_the_same_batches(blend):
    first, second = (training_data(TINY, "bytes", blend, [], SEQ, BATCH, seed=3, split="969,30,1") for _ in range(2))
    for a, b in ((first.train, second.train), (first.valid, second.valid)):
        assert all(np.array_equal(x, y) for x, y in zip(a.rows_at(0, 3 * BATCH)[:2], b.rows_at(0, 3 * BATCH)[:2]))


def test_a_part_left_without_documents_is_refused_naming_the_dataset(tmp_path):
    small = write_dataset(str(tmp_path / "small"), labelled_documents(10, seed=1, min_len=20, max_len=30))
    with pytest.raises(
        ValueError,
        match=re.escape(f"--split 969,30,1: the validation part of {small} (10 documents) holds no document"),
    ):
        training_data(TINY, "bytes", [small], [], SEQ, BATCH, seed=3, split="969,30,1")


def test_without_a_validation_part_evaluation_is_refused(blend):
    with pytest.raises(ValueError, match="needs --valid-data .* or a --split with a validation part"):
        training_data(TINY, "bytes", blend, [], SEQ, BATCH, seed=3, split="100,0,1", needs_validation=True)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--split", "90,x"], "train.py: error: --split '90,x': 'x' is not a number"),
        (
            ["--split", "90,10", "--valid-data", "{b}"],
            "train.py: error: --split and --valid-data both give validation data: keep one",
        ),
        (["--split", "90,10", "--data"], "train.py: error: --split without --data"),
    ],
)
def test_train_py_refuses_bad_splits_with_one_line_and_status_2(blend, flags, words, capsys):
    argv = [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba2.json"),
        "--train-iters",
        "1",
        "--seq-length",
        str(SEQ),
        "--data",
        blend[1],
        *(f.format(b=blend[3]) for f in flags),
    ]
    with pytest.raises(SystemExit) as e:
        load_train_script().main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(words) and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_run_with_split_evaluates_on_its_validation_part(blend, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba2.json"),
        "--train-iters",
        "2",
        "--seq-length",
        str(SEQ),
        "--data",
        *blend,
        "--split",
        "80,15,5",
        "--eval-interval",
        "1",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--metrics-jsonl",
        str(metrics),
    ]
    run_ranks(run_train, 1, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False, timeout=300)
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [0, 1] and all(np.isfinite(r["val_loss"]) for r in records), records
