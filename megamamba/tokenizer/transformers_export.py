"""Our tokenizer as transformers loads it: tokenizer.json, tokenizer_config.json, special_tokens_map.json, checked.

Writes our own files and a `tokenizer.json` that `AutoTokenizer` loads, configured to encode as
ours does, then checks both on sample text; `TokenizerError` names the first text that differs.
Details: docs/checkpoints.md ("Converting to and from Hugging Face and mamba_ssm").
"""

import json
import os
import random

from tokenizers import Tokenizer as Library

from megamamba.data.corpus import python_docs
from megamamba.tokenizer.base import BYTES_MARKER, CONFIG_FILE, Bytes, Tokenizer, TokenizerError
from megamamba.tokenizer.bytes_json import EOD_TOKEN, bytes_as_tokenizers
from megamamba.tokenizer.hf_json import JSON_FILE, HFTokenizer
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


def _library_form(tokenizer: Tokenizer) -> tuple:
    """(the `tokenizers` tokenizer or None to keep ours, transformers' special tokens, split_special_tokens)."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return sentencepiece_as_tokenizers(tokenizer.path), special_pieces(read_model(tokenizer.path)), True
    if isinstance(tokenizer, HFTokenizer):
        return None, {"eos_token": tokenizer.eod_token}, False
    if isinstance(tokenizer, Bytes):
        return bytes_as_tokenizers(), {"eos_token": EOD_TOKEN}, True
    raise TokenizerError(f"tokenizer {tokenizer!r}: no transformers form for this kind")


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _check(ours: Tokenizer, written: Library) -> None:
    for text in _samples():
        ids = ours.encode(text)
        theirs = written.encode(text, add_special_tokens=False).ids
        if theirs != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
            raise TokenizerError(
                f"the tokenizer.json built from {ours!r} encodes {text!r} differently from ours "
                f"from token {at}: {theirs[at : at + 6]} against {ids[at : at + 6]}"
            )
        ids = ids + [ours.eod]
        decoded, expected = written.decode(ids, skip_special_tokens=False), ours.decode(ids)
        if decoded != expected:
            raise TokenizerError(
                f"the tokenizer.json built from {ours!r} decodes the ids of {text!r} (and the "
                f"end-of-document id) as {decoded!r}, ours as {expected!r}"
            )


def write_transformers_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Write the tokenizer's files for transformers (and ours) to `directory`; TokenizerError if they differ."""
    library, special, split_special = _library_form(tokenizer)
    tokenizer.save(directory)
    if library is not None:
        library.save(os.path.join(directory, JSON_FILE))
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": split_special,
    }
    if isinstance(tokenizer, Bytes):
        config.update(BYTES_MARKER)  # find_tokenizer reads the folder as bytes, not as its tokenizer.json
    _write_json(os.path.join(directory, CONFIG_FILE), config)
    _write_json(os.path.join(directory, SPECIAL_TOKENS_FILE), special)
    reread = load_tokenizer(directory)
    if reread.identity != tokenizer.identity:
        raise TokenizerError(
            f"{directory}: the tokenizer read back from the written files is {reread!r}, not {tokenizer!r}"
        )
    written = Library.from_file(os.path.join(directory, JSON_FILE))
    written.encode_special_tokens = split_special  # what transformers does with the config's split_special_tokens
    _check(tokenizer, written)
