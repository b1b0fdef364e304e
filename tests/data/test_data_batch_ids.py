"""Every id read for a batch is checked against the vocabulary: a .bin changed after start-up fails with one
error naming the file and the token, on every rank that reads it, never in the embedding or silently."""

import contextlib
import io
import os

import numpy as np
import pytest

from data_fixtures import corrupt_in_place, write_dataset
from distributed import run_ranks
from megamamba.data.batches import PackedGlobalBatches
from megamamba.data.indexed import DatasetError, IndexedDataset
from megamamba.data.preprocess import preprocess
from megamamba.data.split import split_blend
from train_entry import ROOT, run_train

DOCS = [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]] * 4  # 12 documents, 48 tokens
SEQ = 8


def batches_over(dataset, vocab_size: int) -> PackedGlobalBatches:
    return PackedGlobalBatches([dataset], [1], SEQ, 4, seed=3, vocab_size=vocab_size)


def test_an_id_outside_the_vocabulary_read_for_a_batch_names_the_file_and_the_token(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    dataset = IndexedDataset(prefix, vocab_size=10)
    batches = batches_over(dataset, 10)
    batches.micro_batches(0, 0, 1, 2)
    corrupt_in_place(prefix + ".bin", 17, 300)  # after start-up: the memory map sees the change
    with pytest.raises(DatasetError) as refusal:
        [batches.micro_batches(step, 0, 1, 2) for step in range(4)]
    assert str(refusal.value) == (
        f"{prefix}.bin, token 17 (document 4): token id 300 is outside the vocabulary of 10 ids: the file changed "
        "after start-up checked it; restore it or re-run python -m megamamba.data.preprocess, then resume"
    )


def test_a_negative_id_read_for_a_batch_is_refused_too(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS, dtype=np.int32)
    batches = batches_over(IndexedDataset(prefix, vocab_size=10), 10)
    corrupt_in_place(prefix + ".bin", 3, -2, dtype=np.int32)
    with pytest.raises(DatasetError, match=r"d\.bin, token 3 \(document 0\): token id -2 is outside the vocabulary"):
        [batches.micro_batches(step, 0, 1, 2) for step in range(4)]


def test_an_id_outside_the_vocabulary_in_a_split_part_names_the_datasets_file_and_token(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    valid = split_blend([IndexedDataset(prefix, vocab_size=10)], "50,50,0").valid
    batches = PackedGlobalBatches(valid, [1], SEQ, 2, seed=3, vocab_size=10)
    corrupt_in_place(prefix + ".bin", 40, 300)  # in the validation half (documents 6..11, tokens 24..47)
    with pytest.raises(DatasetError, match=r"d\.bin, token 40 \(document 10\): token id 300 is outside the vocab"):
        [batches.micro_batches(step, 0, 1, 2) for step in range(8)]


def corrupted_run(argv, extensions_dir, bin_path) -> tuple:
    """One rank of `argv`'s run whose .bin gets an id of 300 in every token once start-up has checked it:
    (exit status, stderr lines, steps logged)."""
    from megamamba.data.batches import PackedGlobalBatches

    read = PackedGlobalBatches.micro_batches_at

    def corrupted_first(self, *args, **kwargs):
        tokens = np.memmap(bin_path, np.uint16, "r+")
        tokens[:] = 300
        tokens.flush()
        return read(self, *args, **kwargs)

    PackedGlobalBatches.micro_batches_at = corrupted_first
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            run_train(argv, extensions_dir)
        except SystemExit as e:
            return e.code, errors.getvalue().splitlines()
    return 0, errors.getvalue().splitlines()


@pytest.mark.slow
def test_a_bin_changed_during_a_tp2_run_stops_every_rank_with_one_line_naming_the_file(corpus_jsonl, tmp_path):
    (prefix,) = preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=io.StringIO())
    argv = [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba1.json"),
        "--train-iters",
        "3",
        "--seq-length",
        "32",
        "--tensor-parallel-size",
        "2",
        "--data",
        prefix,
    ]
    args = (argv, os.environ["TORCH_EXTENSIONS_DIR"], prefix + ".bin")
    for status, lines in run_ranks(corrupted_run, 2, args=args, init_process_group=False, timeout=300):
        assert status == 1, lines
        (line,) = [x for x in lines if "error" in x]
        assert line.startswith(f"train.py: error: {prefix}.bin, token ")
        assert "token id 300 is outside the vocabulary of 257 ids: the file changed after start-up checked it" in line
