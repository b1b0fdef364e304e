"""An export's tokenizer: transformers' AutoTokenizer encodes and decodes as ours, or the export is refused.

Four kinds: SentencePiece BPE and unigram (trained on the built-in corpus), a tokenizer.json
(byte-level BPE trained with the `tokenizers` library) and the byte tokenizer. Encoding with special
tokens puts the end-of-document token first, as training and generation feed the model; special
tokens decode to their text unless skipped. Fast tests use the `tokenizers` library on the written
tokenizer.json; the slow ones import transformers (seconds) and load the exported folder with
`AutoTokenizer.from_pretrained`.
"""

import contextlib
import io
import json
import random

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as Library
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from checkpoint_fixtures import perturbed_model, tiny
from megamamba.checkpoint import model_tensors, save_checkpoint
from megamamba.checkpoint.convert import main
from megamamba.data.corpus import python_docs
from megamamba.tokenizer import Bytes, TokenizerError, load_tokenizer, train_sentencepiece, transformers_export
from megamamba.tokenizer.sentencepiece_json import read_model, sentencepiece_as_tokenizers
from megamamba.tokenizer.sentencepiece_model import UNIGRAM_SCORE_STEP

KINDS = ("sentencepiece_bpe", "sentencepiece_unigram", "tokenizer_json", "bytes")
BUILT = ("sentencepiece_bpe", "sentencepiece_unigram", "bytes")  # the export builds their tokenizer.json
SNIPPET_SEED = 1
VARIATIONS = (
    "   ",
    "\n\n",
    "\t",
    "\n    ",
    "naïve café Ωμέγα 日本語 🤖",
    " 0123 456.78 9e-10 ",
    "  \u00a0 ",
    "</s>",
    "<|endoftext|>",
    "<unk>",
    "\r\n",
)


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    docs = python_docs()
    json_tok = Library(models.BPE())
    json_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    json_tok.decoder = decoders.ByteLevel()
    json_tok.post_processor = processors.ByteLevel(trim_offsets=True)  # GPT-NeoX's; the export records it
    json_tok.train_from_iterator(
        docs,
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    json_tok.save(str(root / "tokenizer.json"))
    return {
        "sentencepiece_bpe": load_tokenizer(train_sentencepiece(docs, str(root / "bpe"), 1000, "bpe")),
        "sentencepiece_unigram": load_tokenizer(train_sentencepiece(docs, str(root / "unigram"), 1000, "unigram")),
        "tokenizer_json": load_tokenizer(str(root / "tokenizer.json")),
        "bytes": Bytes(),
    }


def snippets(count: int = 100) -> list:
    """Seeded corpus slices of 1-400 characters, every other one with whitespace runs, newlines, non-ASCII,
    digits or special-looking text inserted."""
    rng, docs = random.Random(SNIPPET_SEED), python_docs()
    out = []
    for i in range(count):
        doc = rng.choice(docs)
        start = rng.randrange(len(doc))
        text = doc[start : start + rng.randint(1, 400)]
        if i % 2:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(VARIATIONS) + text[at:]
        out.append(text)
    return out


def read_json(path) -> dict:
    return json.loads(path.read_text())


def checkpoint_with(tmp_path, tokenizer, layer: str = "Mamba1") -> str:
    config = tiny(layer, vocab_size=tokenizer.vocab_size)
    save_checkpoint(str(tmp_path / "ckpt"), 3, config, model_tensors(perturbed_model(config, 0)), tokenizer=tokenizer)
    return str(tmp_path / "ckpt")


def refusal(argv) -> str:
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        main([str(a) for a in argv])
    assert e.value.code == 2
    lines = [line for line in err.getvalue().splitlines() if not line.startswith("convert: note:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_transformers_files_and_keeps_ours(tmp_path, tokenizers_by_kind, kind):
    ours = tokenizers_by_kind[kind]
    main(["export", "--checkpoint", checkpoint_with(tmp_path, ours), "--output", str(tmp_path / "hf")])
    config = read_json(tmp_path / "hf" / "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["add_bos_token"], config["add_eos_token"], config["clean_up_tokenization_spaces"]) == (
        True,
        False,
        False,
    )
    written = Library.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert written.token_to_id(config["eos_token"]) == ours.eod and config["bos_token"] == config["eos_token"]
    special = read_json(tmp_path / "hf" / "special_tokens_map.json")
    assert (special["bos_token"], special["eos_token"]) == (config["eos_token"],) * 2
    assert load_tokenizer(str(tmp_path / "hf")).identity == ours.identity


@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_the_document_ids_to_both_configs_and_the_tokenizers_vocabulary_without_padding(
    tmp_path, tokenizers_by_kind, kind
):
    """The model's rows are the tokenizer's ids (bytes: 257 of our 264 rows), so generation has none to suppress."""
    ours = tokenizers_by_kind[kind]
    main(["export", "--checkpoint", checkpoint_with(tmp_path, ours), "--output", str(tmp_path / "hf")])
    model, generation = (read_json(tmp_path / "hf" / f"{n}.json") for n in ("config", "generation_config"))
    for ids in (model, generation):
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (ours.eod, ours.eod)
    assert model["vocab_size"] == ours.vocab_size and "suppress_tokens" not in generation


def written_for_transformers(ours, directory) -> tuple:
    """(the export's tokenizer.json read by `tokenizers` as transformers configures it, its EOS text)."""
    transformers_export.write_transformers_tokenizer(ours, str(directory))
    config = read_json(directory / "tokenizer_config.json")
    written = Library.from_file(str(directory / "tokenizer.json"))
    written.encode_special_tokens = config["split_special_tokens"]
    return written, config["eos_token"]


@pytest.mark.parametrize("kind", KINDS)
def test_written_tokenizer_json_encodes_snippets_as_ours_after_the_end_of_document_token(
    tmp_path, tokenizers_by_kind, kind
):
    ours = tokenizers_by_kind[kind]
    written, _ = written_for_transformers(ours, tmp_path)
    for i, text in enumerate(snippets()):
        ids = ours.encode(text)
        assert written.encode(text).ids == [ours.eod] + ids, (kind, i, text)
        assert written.encode(text, add_special_tokens=False).ids == ids, (kind, i, text)
        assert written.decode(ids, skip_special_tokens=False) == ours.decode(ids), (kind, i, text)


@pytest.mark.parametrize("kind", BUILT)
def test_built_tokenizer_json_decodes_the_end_of_document_token_to_its_text_unless_skipped(
    tmp_path, tokenizers_by_kind, kind
):
    ours = tokenizers_by_kind[kind]
    written, eos = written_for_transformers(ours, tmp_path)
    assert written.decode([ours.eod], skip_special_tokens=False) == eos
    for i, text in enumerate(snippets()):
        ids = ours.encode(text)
        assert written.decode(ids + [ours.eod], skip_special_tokens=False) == ours.decode(ids) + eos, (kind, i)
        assert written.decode([ours.eod] + ids + [ours.eod], skip_special_tokens=True) == ours.decode(ids), (kind, i)


def test_bytes_export_decodes_any_ids_as_ours_invalid_utf8_included(tmp_path):
    written, eos = written_for_transformers(Bytes(), tmp_path)
    rng = random.Random(2)
    for _ in range(500):
        ids = [rng.randrange(Bytes.vocab_size) for _ in range(rng.randint(1, 12))]
        named = b"".join(eos.encode() if i == Bytes.eod else bytes([i]) for i in ids).decode("utf-8", "replace")
        assert written.decode(ids, skip_special_tokens=False) == named, (ids, "seed 2")
        assert written.decode(ids, skip_special_tokens=True) == Bytes().decode(ids), (ids, "seed 2")


def test_sentencepiece_special_pieces_in_text_are_plain_text_as_in_sentencepiece(tmp_path, tokenizers_by_kind):
    ours = tokenizers_by_kind["sentencepiece_bpe"]
    transformers_export.write_transformers_tokenizer(ours, str(tmp_path))
    written = Library.from_file(str(tmp_path / "tokenizer.json"))
    written.encode_special_tokens = True
    ids = written.encode("a</s>b<unk>", add_special_tokens=False).ids
    assert ids == ours.encode("a</s>b<unk>") and ours.eod not in ids


def test_unigram_training_puts_scores_on_the_grid_ties_need(tokenizers_by_kind):
    scores = [p.score for p in read_model(tokenizers_by_kind["sentencepiece_unigram"].path).pieces]
    assert all(s / UNIGRAM_SCORE_STEP == round(s / UNIGRAM_SCORE_STEP) for s in scores)


def test_an_export_that_would_encode_differently_is_refused_and_no_tokenizer_skips_it(
    tmp_path, tokenizers_by_kind, monkeypatch
):
    ours = tokenizers_by_kind["sentencepiece_bpe"]
    other = tokenizers_by_kind["sentencepiece_unigram"].path
    monkeypatch.setattr(
        transformers_export, "sentencepiece_as_tokenizers", lambda path: sentencepiece_as_tokenizers(other)
    )
    ckpt = checkpoint_with(tmp_path, ours)
    message = refusal(["export", "--checkpoint", ckpt, "--output", tmp_path / "hf"])
    assert message.startswith("convert export: error: the tokenizer.json built from SentencePieceTokenizer(")
    assert "differently from ours from token" in message and "--no-tokenizer exports the model without" in message
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".tmp-hf-*"))
    main(["export", "--checkpoint", ckpt, "--output", str(tmp_path / "hf"), "--no-tokenizer"])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_a_sentencepiece_option_without_tokenizer_json_equivalent_is_named(tmp_path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(python_docs()[:20]),
        model_writer=model,
        vocab_size=300,
        treat_whitespace_as_suffix=True,
        minloglevel=2,
    )
    (tmp_path / "suffix.model").write_bytes(model.getvalue())
    with pytest.raises(TokenizerError, match=r"suffix.model: treat_whitespace_as_suffix=true has no tokenizer.json"):
        transformers_export.write_transformers_tokenizer(load_tokenizer(str(tmp_path / "suffix.model")), str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_auto_tokenizer_of_the_export_encodes_and_decodes_100_snippets_as_ours(
    tmp_path, tokenizers_by_kind, kind, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    ours = tokenizers_by_kind[kind]
    main(["export", "--checkpoint", checkpoint_with(tmp_path, ours, "Mamba2"), "--output", str(tmp_path / "hf")])
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for i, text in enumerate(snippets()):
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == [ours.eod] + ids, (kind, i, text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, (kind, i, text)
        assert theirs.decode(ids) == ours.decode(ids), (kind, i, text)
    assert theirs.eos_token_id == theirs.bos_token_id == ours.eod
    assert theirs.decode([ours.eod]) == theirs.eos_token and theirs.decode([ours.eod], skip_special_tokens=True) == ""
    model, info = transformers.Mamba2ForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info
