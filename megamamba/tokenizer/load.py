"""`load_tokenizer(spec)`: one string names any tokenizer the project uses.

"bytes"                      the byte tokenizer (257 ids)
path/to/name.model           a SentencePiece model
path/to/tokenizer.json       a Hugging Face tokenizers file
path/to/folder               the tokenizer a `save` wrote there: tokenizer_config.json naming
                             "bytes" (a transformers export of it also holds a tokenizer.json),
                             else tokenizer.model, else tokenizer.json
"""

import json
import os

from megamamba.tokenizer.base import BYTES_MARKER, CONFIG_FILE, Bytes, Tokenizer, TokenizerError
from megamamba.tokenizer.hf_json import JSON_FILE, HFTokenizer
from megamamba.tokenizer.sentencepiece_model import MODEL_FILE, SentencePieceTokenizer

BYTES_SPEC = "bytes"


def find_tokenizer(directory: str):
    """The spec of the tokenizer saved in `directory`, or None when it holds none."""
    config = os.path.join(directory, CONFIG_FILE)
    if os.path.isfile(config):
        with open(config) as f:
            fields = json.load(f)
        if isinstance(fields, dict) and BYTES_MARKER.items() <= fields.items():
            return BYTES_SPEC
    for name in (MODEL_FILE, JSON_FILE):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names (see the module docstring)."""
    if spec == BYTES_SPEC:
        return Bytes()
    if os.path.isdir(spec):
        found = find_tokenizer(spec)
        if found is None:
            raise TokenizerError(
                f"tokenizer folder {spec!r} holds no {MODEL_FILE}, {JSON_FILE} or {CONFIG_FILE} naming {BYTES_SPEC!r}"
            )
        return load_tokenizer(found)
    if not os.path.isfile(spec):
        raise TokenizerError(f"tokenizer {spec!r}: no such file or folder, and not {BYTES_SPEC!r}")
    if spec.endswith(".model"):
        return SentencePieceTokenizer(spec)
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    raise TokenizerError(
        f"tokenizer {spec!r}: expected {BYTES_SPEC!r}, a SentencePiece .model, a tokenizer.json or a folder holding one"
    )
