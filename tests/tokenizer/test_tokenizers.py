"""Tokenizers: SentencePiece training is reproducible and lossless; HF tokenizer.json and folders load."""

import json

import pytest
from tokenizers import Tokenizer as HFLibTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from data_fixtures import TEXTS
from megamamba import MambaConfig
from megamamba.tokenizer import (
    Bytes,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    check_vocab,
    config_with_vocab,
    find_tokenizer,
    load_tokenizer,
    train_sentencepiece,
)

CORPUS = [f"{i} {t}" for i in range(30) for t in TEXTS]
SAMPLES = TEXTS + ["never seen: ǅ Ω ∑ \x00 tab\tend", " a leading space", "\n"]


def trained(tmp_path, name="spm", model_type="bpe", vocab_size=330, seed=0):
    return train_sentencepiece(CORPUS, str(tmp_path / name), vocab_size, model_type, seed=seed)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_training_is_reproducible(tmp_path, model_type):
    first = trained(tmp_path, "a", model_type)
    second = trained(tmp_path, "b", model_type)
    with open(first, "rb") as f, open(second, "rb") as g:
        assert f.read() == g.read(), f"{model_type}: two trainings on the same input differ"


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_round_trips_any_text(tmp_path, model_type):
    tok = load_tokenizer(trained(tmp_path, model_type=model_type))
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 330
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids, f"{text!r}: the end-of-document id appears inside text"
        assert tok.decode(ids) == text


def test_sentencepiece_merges_frequent_text(tmp_path):
    tok = load_tokenizer(trained(tmp_path))
    text = CORPUS[0]
    assert len(tok.encode(text)) < 0.8 * len(text.encode())


def test_sentencepiece_refuses_a_vocab_below_the_byte_pieces(tmp_path):
    with pytest.raises(TokenizerError, match="vocab size 100: must be an integer >= 260"):
        trained(tmp_path, vocab_size=100)


def tiny_hf_tokenizer_json(path, eod="<|endoftext|>"):
    """A byte-level BPE tokenizer.json (GPT-NeoX style) trained on the test corpus."""
    tok = HFLibTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=450, special_tokens=[eod], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_json_loads_and_round_trips(tmp_path):
    path = tiny_hf_tokenizer_json(tmp_path / "tokenizer.json")
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == 0
    assert tok.vocab_size == HFLibTokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_hf_end_of_document_token_comes_from_tokenizer_config(tmp_path):
    path = tiny_hf_tokenizer_json(tmp_path / "tokenizer.json", eod="<|stop|>")
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        load_tokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|stop|>"}))
    assert load_tokenizer(path).eod == 0


@pytest.mark.parametrize("kind", ["bytes", "sentencepiece", "hf"])
def test_saved_tokenizer_loads_from_its_folder(tmp_path, kind):
    source = {
        "bytes": lambda: "bytes",
        "sentencepiece": lambda: trained(tmp_path),
        "hf": lambda: tiny_hf_tokenizer_json(tmp_path / "src.json"),
    }[kind]()
    tok = load_tokenizer(source)
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder))
    again = load_tokenizer(str(folder))
    assert type(again) is type(tok)
    assert (again.vocab_size, again.eod) == (tok.vocab_size, tok.eod)
    assert again.encode(SAMPLES[0]) == tok.encode(SAMPLES[0])


def test_byte_tokenizer_spec():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, Bytes) and (tok.vocab_size, tok.eod) == (257, 256)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("missing.model", "no such file or folder"),
        ("empty_dir", "holds no tokenizer.model, tokenizer.json"),
        ("notes.txt", "expected 'bytes', a SentencePiece .model"),
        ("bad.model", "not a readable SentencePiece model"),
        ("bad.json", "not a readable tokenizer.json"),
    ],
)
def test_unusable_tokenizer_specs_fail_clearly(tmp_path, spec, message):
    (tmp_path / "empty_dir").mkdir()
    for name in ("notes.txt", "bad.model", "bad.json"):
        (tmp_path / name).write_text("garbage")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(str(tmp_path / spec))


def test_folder_without_tokenizer_is_reported_as_none(tmp_path):
    assert find_tokenizer(str(tmp_path)) is None


def test_vocab_size_flows_into_the_config_and_mismatch_is_refused():
    config = MambaConfig(d_model=16, n_layer=1, vocab_size=100)
    tok = load_tokenizer("bytes")
    with pytest.raises(TokenizerError, match="has 257 ids but the model config's vocab_size is 100"):
        check_vocab(config, tok)
    fitted = config_with_vocab(config, tok)
    assert fitted.vocab_size == 257 and fitted.padded_vocab_size == 264
    check_vocab(fitted, tok)
