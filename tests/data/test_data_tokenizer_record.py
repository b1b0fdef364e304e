"""Datasets record the tokenizer that made them; training refuses data made with another one by
name (--allow-tokenizer-mismatch overrides), and accepts datasets without a record with a warning."""

import io
import json
import os
import shutil

import pytest

from data_fixtures import TEXTS, write_dataset
from megamamba import MambaConfig
from megamamba.data.dataset_meta import META_SUFFIX, check_tokenizer, read_tokenizer_record
from megamamba.data.indexed import DatasetError
from megamamba.data.preprocess import preprocess
from megamamba.data.training_data import training_data
from megamamba.tokenizer import load_tokenizer, train_sentencepiece

SSM = {"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 16}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i} {t}"}) + "\n" for i in range(20) for t in TEXTS if t))
    return str(path)


@pytest.fixture
def spm(tmp_path):
    return train_sentencepiece([f"{i} {t}" for i in range(30) for t in TEXTS], str(tmp_path / "spm"), 330)


def made_with(corpus, prefix, spec) -> str:
    (prefix,) = preprocess([corpus], spec, str(prefix), progress_stream=io.StringIO())
    return prefix


def data_for(prefix, spec, **kw):
    model = MambaConfig(d_model=16, n_layer=1, vocab_size=336, ssm_cfg=SSM)
    return training_data(model, spec, [prefix], [], 16, 4, 0, **kw)


def test_preprocess_records_the_tokenizer_beside_the_index(corpus, spm, tmp_path):
    prefix = made_with(corpus, tmp_path / "b", "bytes")
    assert read_tokenizer_record(prefix) == {"name": "bytes", "identity": "bytes", "vocab_size": 257}
    prefix = made_with(corpus, tmp_path / "s", spm)
    record = read_tokenizer_record(prefix)
    assert record["identity"].startswith("sha256:") and record["vocab_size"] == 330 and record["name"] == spm


def test_training_with_another_tokenizer_is_refused_by_name(corpus, spm, tmp_path):
    prefix = made_with(corpus, tmp_path / "b", "bytes")
    with pytest.raises(DatasetError) as e:
        data_for(prefix, spm)
    message = str(e.value)
    assert f"{prefix}: made with tokenizer 'bytes' (bytes, 257 ids), but --tokenizer is '{spm}' (sha256:" in message
    assert "330 ids" in message and "--allow-tokenizer-mismatch" in message and "\n" not in message


def test_the_mismatch_is_allowed_with_the_flag_and_a_warning(corpus, spm, tmp_path):
    prefix = made_with(corpus, tmp_path / "b", "bytes")
    data = data_for(prefix, spm, allow_tokenizer_mismatch=True)
    assert len(data.warnings) == 1 and "training on it anyway (--allow-tokenizer-mismatch)" in data.warnings[0]
    assert data.train.rows_at(0, 4)[0].shape == (4, 16)


def test_the_same_tokenizer_from_another_place_matches(corpus, spm, tmp_path):
    prefix = made_with(corpus, tmp_path / "s", spm)
    folder = tmp_path / "checkpoint_folder"
    folder.mkdir()
    load_tokenizer(spm).save(str(folder))
    assert data_for(prefix, str(folder)).warnings == []


def test_a_dataset_without_a_record_is_accepted_with_a_warning(tmp_path):
    prefix = write_dataset(str(tmp_path / "old"), [[5, 6, 7, 0]] * 40)
    assert not os.path.exists(prefix + META_SUFFIX)
    warning, checksum_warning = data_for(prefix, "bytes").warnings
    assert warning.startswith(f"{prefix}: no {META_SUFFIX} tokenizer record") and "re-run preprocess" in warning
    assert checksum_warning.startswith(f"{prefix}.bin: no checksum recorded")


def test_a_malformed_record_is_one_error(corpus, tmp_path):
    prefix = made_with(corpus, tmp_path / "b", "bytes")
    shutil.copyfile(corpus, prefix + META_SUFFIX)
    with pytest.raises(DatasetError, match=r"\.meta\.json: not a readable dataset record"):
        check_tokenizer(prefix, load_tokenizer("bytes"), "bytes")
