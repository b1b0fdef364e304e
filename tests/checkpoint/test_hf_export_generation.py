"""transformers on an export, used as its users use it: `tok(text)` feeds the model what ours fed it.

Two exports shared by the module: a pure Mamba-2 with a SentencePiece tokenizer (EOS `</s>`) and a
NemotronH hybrid with the byte tokenizer (EOS `<|endoftext|>`). `AutoTokenizer` puts the
end-of-document token first, as training and `megamamba.generate` do, and greedy
`generate` from `tok(prompt)` gives our greedy text. Slow: transformers' import and generation take seconds.
"""

import pytest
import torch

from checkpoint_fixtures import perturbed_model, tiny
from convert_cli import convert
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.data.corpus import python_docs
from megamamba.generate import generate, generate_ids
from megamamba.tokenizer import load_tokenizer, train_sentencepiece
from test_hybrid_interop import pattern_model

TEXTS = (
    "naïve café Ωμέγα 日本語 🤖",
    "line one\nline two\n\n\tindented\r\n",
    "a document ends with </s> or <|endoftext|>, written out",
    " a leading space and trailing ones  ",
)
PROMPTS = ("def f(x):\n    return", "x = 1", "\n", "</s> literally")
NEW_TOKENS = 16
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: (our model, our tokenizer, transformers' model, transformers' tokenizer)}."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("exports")
    spm = load_tokenizer(train_sentencepiece(python_docs(), str(root / "spm"), 400, "bpe"))
    models = {
        "mamba2_sentencepiece": (perturbed_model(tiny("Mamba2", vocab_size=spm.vocab_size), 5), spm),
        "nemotron_h_bytes": (pattern_model("tied"), load_tokenizer("bytes")),
    }
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for name, (model, tok) in models.items():
            save_model_folder(model, str(root / name), tokenizer=tok)
            convert("export", "--checkpoint", root / name, "--output", root / f"{name}-hf")
            theirs = transformers.AutoModelForCausalLM.from_pretrained(str(root / f"{name}-hf")).eval()
            theirs_tok = transformers.AutoTokenizer.from_pretrained(str(root / f"{name}-hf"))
            out[name] = (model.eval(), tok, theirs, theirs_tok)
    return out


def greedy_ids(theirs, encoding) -> list:
    with torch.no_grad():
        out = theirs.generate(**encoding, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, encoding["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("name", ["mamba2_sentencepiece", "nemotron_h_bytes"])
def test_auto_tokenizer_encodes_texts_as_ours_after_the_end_of_document_token(exports, name):
    _, ours, _, theirs = exports[name]
    assert theirs.bos_token_id == theirs.eos_token_id == ours.eod
    for text in TEXTS:
        assert theirs(text).input_ids == [ours.eod] + ours.encode(text), (name, text)
        assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text), (name, text)


@pytest.mark.parametrize(("name", "eos"), [("mamba2_sentencepiece", "</s>"), ("nemotron_h_bytes", "<|endoftext|>")])
def test_auto_tokenizer_decodes_the_end_of_document_token_to_its_text_unless_skipped(exports, name, eos):
    _, ours, _, theirs = exports[name]
    ids = ours.encode(TEXTS[0])
    assert theirs.decode([ours.eod]) == theirs.eos_token == eos
    assert theirs.decode([ours.eod] + ids + [ours.eod]) == eos + ours.decode(ids) + eos
    assert theirs.decode([ours.eod] + ids + [ours.eod], skip_special_tokens=True) == ours.decode(ids)


@pytest.mark.parametrize("name", ["mamba2_sentencepiece", "nemotron_h_bytes"])
def test_transformers_greedy_generation_from_tok_of_the_prompt_is_ours(exports, name):
    """The same ids up to the end-of-document token, past which transformers stops (never a padding id)."""
    model, ours, theirs, theirs_tok = exports[name]
    for prompt in PROMPTS:
        new = greedy_ids(theirs, theirs_tok(prompt, return_tensors="pt"))
        ids = generate_ids(model, torch.tensor([[ours.eod] + ours.encode(prompt)]), NEW_TOKENS, greedy=True)[0]
        expected = ids.tolist()[: ids.tolist().index(ours.eod) + 1] if ours.eod in ids else ids.tolist()
        assert new == expected, (name, prompt)


def test_transformers_greedy_text_of_the_byte_export_is_ours(exports):
    """Text too: the byte export decodes any ids as ours (SentencePiece's replacement of invalid UTF-8
    byte pieces differs from the `tokenizers` library's, which a random model's ids show)."""
    model, ours, theirs, theirs_tok = exports["nemotron_h_bytes"]
    for prompt in PROMPTS:
        new = greedy_ids(theirs, theirs_tok(prompt, return_tensors="pt"))
        expected = generate(model, ours, prompt, max_new_tokens=NEW_TOKENS, greedy=True)
        assert theirs_tok.decode(new, skip_special_tokens=True) == expected, prompt


@pytest.mark.parametrize("name", ["mamba2_sentencepiece", "nemotron_h_bytes"])
def test_without_the_end_of_document_token_some_prompt_generates_otherwise(exports, name):
    """What the document-start token is worth: the generation test would see it missing."""
    model, ours, theirs, theirs_tok = exports[name]
    differ = [
        prompt
        for prompt in PROMPTS
        if greedy_ids(theirs, theirs_tok(prompt, add_special_tokens=False, return_tensors="pt"))
        != generate_ids(model, torch.tensor([[ours.eod] + ours.encode(prompt)]), NEW_TOKENS, greedy=True)[0].tolist()
    ]
    assert differ, f"{name}: every prompt generated the same with and without the end-of-document token first"
