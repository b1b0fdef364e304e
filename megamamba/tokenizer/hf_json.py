"""Hugging Face `tokenizer.json` files (the `tokenizers` library), e.g. GPT-NeoX's for Mamba checkpoints.

The end-of-document token is the `eos_token` of a `tokenizer_config.json` beside the file when
there is one, else the first of the usual end-of-text names the vocabulary holds. A transformers
export's file puts that token first for transformers (transformers_export.py); the config beside it
records the file's own post-processor, which is restored here, so the tokenizer is the one exported.
"""

import hashlib
import json
import os

from tokenizers import Tokenizer as _HFTokenizer

from megamamba.tokenizer.base import CONFIG_FILE, TokenizerError

JSON_FILE = "tokenizer.json"
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


# the tokenizer_config.json key under which a transformers export records the file's own post-processor
OWN_POST_PROCESSOR = "megamamba_post_processor"


def _config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _with_post_processor(tok: _HFTokenizer, post_processor) -> _HFTokenizer:
    """A copy of `tok` with `post_processor` (its JSON form; None for none)."""
    definition = json.loads(tok.to_str())
    definition["post_processor"] = post_processor
    return _HFTokenizer.from_str(json.dumps(definition))


class HFTokenizer:
    """A `tokenizers` tokenizer loaded from tokenizer.json; vocab_size counts the added tokens."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception subclass for bad files
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
        config = _config(os.path.dirname(os.path.abspath(path)))
        if OWN_POST_PROCESSOR in config:
            self._tok = _with_post_processor(self._tok, config[OWN_POST_PROCESSOR])
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        configured = config.get("eos_token")
        configured = configured.get("content") if isinstance(configured, dict) else configured
        names = (configured,) if configured else EOD_NAMES
        found = [n for n in names if n in vocab]
        if not found:
            raise TokenizerError(f"{path}: no end-of-document token; looked for {list(names)} in its vocabulary")
        self.eod_token = found[0]
        self.eod = vocab[self.eod_token]
        # of the parsed definition, not the file's bytes: save() rewrites the file in its own formatting
        named = self.definition + "\n" + self.eod_token
        self.identity = "sha256:" + hashlib.sha256(named.encode()).hexdigest()

    @property
    def definition(self) -> str:
        """The tokenizer's `tokenizer.json` text."""
        return self._tok.to_str()

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
