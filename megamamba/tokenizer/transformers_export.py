"""Our tokenizer as transformers loads it: tokenizer.json, tokenizer_config.json, special_tokens_map.json, checked.

Writes our own files and a `tokenizer.json` that `AutoTokenizer` loads, configured to encode as
ours does and to put the end-of-document token first, as the BOS: training starts every document
after it and `megamamba.generate` prepends it, so `tok(text).input_ids` is what the model was fed
(`add_special_tokens=False` leaves it out). Special tokens decode to their text, which
`skip_special_tokens=True` drops. The export checks both on sample text; `TokenizerError` names
the first text that differs. Details: docs/checkpoints.md ("Converting to and from Hugging Face and mamba_ssm").
"""

import json
import os
import random
from typing import NamedTuple

from tokenizers import Tokenizer as Library
from tokenizers import processors

from megamamba.data.corpus import python_docs
from megamamba.tokenizer.base import BYTES_MARKER, CONFIG_FILE, Bytes, Tokenizer, TokenizerError
from megamamba.tokenizer.bytes_json import EOD_TOKEN, bytes_as_tokenizers
from megamamba.tokenizer.hf_json import JSON_FILE, OWN_POST_PROCESSOR, HFTokenizer
from megamamba.tokenizer.load import load_tokenizer
from megamamba.tokenizer.sentencepiece_json import read_model, sentencepiece_as_tokenizers, special_pieces
from megamamba.tokenizer.sentencepiece_model import SentencePieceTokenizer

SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
SAMPLES = (
    "",
    " ",
    "\n",
    "Hello, world!",
    " a leading space",
    "  runs   of    spaces  ",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\nand\x0bothers\x0c",
    "digits 0123456789, 3.14159, 1e-5, 2**31 - 1",
    "café naïve Ωμέγα Привет 日本語 한국어 ǅ e\u0301",
    "emoji 🤖🎉 and zero-width\u200b\u200djoiners",
    "no-break\u00a0space and ideographic\u3000space",
    "\x00 control \x01 bytes \x7f",
    "special-looking text: </s> <s> <unk> <pad> <0x41> <|endoftext|>",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n\n\n",
    "****************************\n=====\n--------",
)
SNIPPETS, SNIPPET_SEED = 48, 0


def _samples() -> list:
    """SAMPLES and seeded snippets (up to 300 characters) of the built-in corpus."""
    rng, docs = random.Random(SNIPPET_SEED), python_docs()
    snippets = []
    for _ in range(SNIPPETS):
        doc = rng.choice(docs)
        start = rng.randrange(len(doc))
        snippets.append(doc[start : start + rng.randint(1, 300)])
    return list(SAMPLES) + snippets


class _Form(NamedTuple):
    """How a tokenizer is written for transformers."""

    library: Library  # tokenizer.json's contents, but for the document-start post-processor
    special: dict  # transformers' special tokens; the end-of-document token is EOS and BOS alike
    split_special: bool  # split_special_tokens: special tokens in text are plain text, as ours reads them
    ours: dict  # what tokenizer_config.json carries for load_tokenizer


def _form(tokenizer: Tokenizer) -> _Form:
    if isinstance(tokenizer, SentencePieceTokenizer):
        special = special_pieces(read_model(tokenizer.path))
        special["bos_token"] = special["eos_token"]
        return _Form(sentencepiece_as_tokenizers(tokenizer.path), special, True, {})
    if isinstance(tokenizer, HFTokenizer):
        own = json.loads(tokenizer.definition)["post_processor"]
        special = {"bos_token": tokenizer.eod_token, "eos_token": tokenizer.eod_token}
        return _Form(Library.from_str(tokenizer.definition), special, False, {OWN_POST_PROCESSOR: own})
    if isinstance(tokenizer, Bytes):
        return _Form(bytes_as_tokenizers(), {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN}, True, BYTES_MARKER)
    raise TokenizerError(f"tokenizer {tokenizer!r}: no transformers form for this kind")


def document_start(token: str, token_id: int) -> processors.TemplateProcessing:
    """The post-processor that puts `token` before each text, as transformers' add_bos_token builds it."""
    return processors.TemplateProcessing(
        single=f"{token}:0 $A:0", pair=f"{token}:0 $A:0 {token}:1 $B:1", special_tokens=[(token, token_id)]
    )


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _first_difference(theirs: list, ours: list) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"from token {at}: {theirs[at : at + 6]} against {ours[at : at + 6]}"


def _check_encoding(ours: Tokenizer, written: Library, text: str) -> None:
    ids = ours.encode(text)
    theirs = written.encode(text, add_special_tokens=False).ids
    if theirs != ids:
        raise TokenizerError(
            f"the tokenizer.json built from {ours!r} encodes {text!r} differently from ours "
            f"{_first_difference(theirs, ids)}"
        )
    theirs = written.encode(text).ids
    if theirs != [ours.eod] + ids:
        raise TokenizerError(
            f"the tokenizer.json built from {ours!r} encodes {text!r} with special tokens not as the "
            f"end-of-document id followed by ours {_first_difference(theirs, [ours.eod] + ids)}"
        )


def _check_decoding(ours: Tokenizer, written: Library, text: str, eod_token: str) -> None:
    """The text's ids and the end-of-document id decode to ours and the token's text, or ours alone when skipped."""
    ids = ours.encode(text) + [ours.eod]
    for skip, expected in ((False, ours.decode(ids) + eod_token), (True, ours.decode(ids))):
        decoded = written.decode(ids, skip_special_tokens=skip)
        if decoded != expected:
            raise TokenizerError(
                f"the tokenizer.json built from {ours!r} decodes the ids of {text!r} and the end-of-document "
                f"id with skip_special_tokens={skip} as {decoded!r}, not {expected!r}"
            )


def write_transformers_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Write the tokenizer's files for transformers (and ours) to `directory`; TokenizerError if they differ."""
    form = _form(tokenizer)
    tokenizer.save(directory)
    form.library.post_processor = document_start(form.special["bos_token"], tokenizer.eod)
    form.library.save(os.path.join(directory, JSON_FILE))
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        **form.special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": form.split_special,
        **form.ours,
    }
    _write_json(os.path.join(directory, CONFIG_FILE), config)
    _write_json(os.path.join(directory, SPECIAL_TOKENS_FILE), form.special)
    reread = load_tokenizer(directory)
    if reread.identity != tokenizer.identity:
        raise TokenizerError(
            f"{directory}: the tokenizer read back from the written files is {reread!r}, not {tokenizer!r}"
        )
    written = Library.from_file(os.path.join(directory, JSON_FILE))
    written.encode_special_tokens = form.split_special  # what transformers does with split_special_tokens
    for text in _samples():
        _check_encoding(tokenizer, written, text)
        if not isinstance(tokenizer, HFTokenizer):  # ours decodes with a tokenizer.json of ours: the same decoder
            _check_decoding(tokenizer, written, text, form.special["eos_token"])
