"""A dataset's .bin is checked by content: its checksum, recorded when it is written, is compared at every
start-up (a file changed in place with its size and mtime kept is refused before any process group)."""

import io
import json
import os
import zlib

import pytest
import torch.distributed as dist

from data_fixtures import corrupt_in_place, write_dataset
from megamamba.data.dataset_meta import META_SUFFIX
from megamamba.data.indexed import DatasetError, IndexedDataset
from megamamba.data.preprocess import preprocess
from train_entry import ROOT, load_train_script

DOCS = [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]] * 4


def crc32_of(path: str) -> str:
    with open(path, "rb") as f:
        return f"crc32:{zlib.crc32(f.read()):08x}"


def files_of(prefix: str) -> dict:
    return {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx", META_SUFFIX)}


@pytest.fixture
def preprocessed(corpus_jsonl, tmp_path):
    (prefix,) = preprocess([corpus_jsonl], "bytes", str(tmp_path / "c"), progress_stream=io.StringIO())
    return prefix


def test_a_bin_corrupted_in_place_with_its_size_and_mtime_kept_is_refused_naming_both_checksums(preprocessed):
    recorded = crc32_of(preprocessed + ".bin")
    corrupt_in_place(preprocessed + ".bin", 14, 65000)
    before = files_of(preprocessed)
    with pytest.raises(DatasetError) as refusal:
        IndexedDataset(preprocessed, vocab_size=257)
    assert str(refusal.value) == (
        f"{preprocessed}.bin: checksum {crc32_of(preprocessed + '.bin')}, but {preprocessed}{META_SUFFIX} records "
        f"{recorded}: the file changed after it was recorded (corrupted, or modified in place); re-run python -m "
        "megamamba.data.preprocess to rewrite the dataset, or restore the file from a good copy"
    )
    assert files_of(preprocessed) == before


def test_train_py_refuses_a_corrupted_bin_at_start_up_in_one_line_before_any_process_group(
    preprocessed, tmp_path, capsys, monkeypatch
):
    corrupt_in_place(preprocessed + ".bin", 14, 300)  # an id past the vocabulary: the old check let it through
    before = files_of(preprocessed)
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(ROOT / "launch/models/tiny-mamba1.json"),
        "--train-iters",
        "20",
        "--seq-length",
        "32",
        "--data",
        preprocessed,
    ]
    with pytest.raises(SystemExit) as exit_info:
        load_train_script().main(argv)
    assert exit_info.value.code == 2 and not dist.is_initialized()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"train.py: error: {preprocessed}.bin: checksum crc32:")
    assert line.endswith(
        "re-run python -m megamamba.data.preprocess to rewrite the dataset, or restore the file from a good copy"
    )
    assert files_of(preprocessed) == before


def test_a_dataset_without_a_checksum_records_one_at_first_use_with_one_warning_then_is_checked(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)  # as Megatron's tools, or preprocessing before checksums
    first = IndexedDataset(prefix, vocab_size=10)
    assert first.warning == (
        f"{prefix}.bin: no checksum recorded (written before checksums were, or by another tool): recorded "
        f"{crc32_of(prefix + '.bin')} from its content as it is now, which later start-ups check it against (re-run "
        "python -m megamamba.data.preprocess to record one from the source text instead)"
    )
    assert IndexedDataset(prefix, vocab_size=10).warning is None
    corrupt_in_place(prefix + ".bin", 2, 4)
    with pytest.raises(DatasetError, match=r"d\.bin: checksum crc32:\w{8}, but .*d\.meta\.json records crc32:"):
        IndexedDataset(prefix, vocab_size=10)


def test_a_record_from_before_checksums_is_scanned_again_and_gains_one(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS)
    stat = os.stat(prefix + ".bin")
    old = {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns, "min_id": 0, "max_id": 9}
    with open(prefix + META_SUFFIX, "w") as f:
        json.dump({"format": "megamamba-dataset", "version": 1, "tokens": old}, f)
    corrupt_in_place(prefix + ".bin", 2, 12)  # the old record's size and mtime still match
    with pytest.raises(DatasetError, match=r"d\.bin: token id 12 is outside the vocabulary of 10 ids"):
        IndexedDataset(prefix, vocab_size=10)
    with open(prefix + META_SUFFIX) as f:
        assert json.load(f)["tokens"] == {"checksum": crc32_of(prefix + ".bin"), "min_id": 0, "max_id": 12}
