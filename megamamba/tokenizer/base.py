"""What every tokenizer offers, and the byte tokenizer in that form.

A tokenizer has `vocab_size` (ids are 0..vocab_size-1), `eod` (the end-of-document id that
preprocessing appends to every document and generation starts from), `identity` (a string equal
for the same tokenizer wherever its files live: "bytes", or "sha256:<hex>" of its definition;
datasets record it), `encode(text) -> list[int]`,
`decode(ids) -> str`, and `save(directory)`, which writes the files `load_tokenizer(directory)`
reads back (so a model folder carries its tokenizer).
"""

import json
import os
from typing import Protocol, Sequence

from megamamba.errors import MegamambaError
from megamamba.tokenizer.byte_tokenizer import ByteTokenizer

CONFIG_FILE = "tokenizer_config.json"
BYTES_MARKER = {"megamamba_tokenizer": "bytes"}


class Tokenizer(Protocol):
    vocab_size: int
    eod: int
    identity: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str) -> None: ...


class TokenizerError(MegamambaError, ValueError):
    """A tokenizer file or spec that cannot be used; the message names it and the rule."""


class Bytes(ByteTokenizer):
    """UTF-8 bytes 0..255 and the end-of-document id 256; spec "bytes"."""

    identity = "bytes"

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(BYTES_MARKER, f)
            f.write("\n")

    def __repr__(self) -> str:
        return "Bytes()"
