"""Hugging Face `tokenizer.json` files (the `tokenizers` library), e.g. GPT-NeoX's for Mamba checkpoints.

The end-of-document token is the `eos_token` of a `tokenizer_config.json` beside the file when
there is one, else the first of the usual end-of-text names the vocabulary holds.
"""

import hashlib
import json
import os

from tokenizers import Tokenizer as _HFTokenizer

from megamamba.tokenizer.base import CONFIG_FILE, TokenizerError

JSON_FILE = "tokenizer.json"
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def _configured_eos(directory: str):
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


class HFTokenizer:
    """A `tokenizers` tokenizer loaded from tokenizer.json; vocab_size counts the added tokens."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception subclass for bad files
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        configured = _configured_eos(os.path.dirname(os.path.abspath(path)))
        names = (configured,) if configured else EOD_NAMES
        found = [n for n in names if n in vocab]
        if not found:
            raise TokenizerError(f"{path}: no end-of-document token; looked for {list(names)} in its vocabulary")
        self.eod_token = found[0]
        self.eod = vocab[self.eod_token]
        # of the parsed definition, not the file's bytes: save() rewrites the file in its own formatting
        definition = self._tok.to_str() + "\n" + self.eod_token
        self.identity = "sha256:" + hashlib.sha256(definition.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str) -> None:
        self._tok.save(os.path.join(directory, JSON_FILE))
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump({"eos_token": self.eod_token}, f)
            f.write("\n")

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"
