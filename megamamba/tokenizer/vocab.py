"""The tokenizer's vocabulary in the model config: set it for a new model, check it for an existing one."""

import dataclasses

from megamamba.config import MambaConfig
from megamamba.tokenizer.base import Tokenizer, TokenizerError


def config_with_vocab(config: MambaConfig, tokenizer: Tokenizer) -> MambaConfig:
    """A copy of `config` whose vocab_size is the tokenizer's (the embedding is then padded as usual)."""
    return dataclasses.replace(config, vocab_size=tokenizer.vocab_size)


def check_vocab(config: MambaConfig, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer that emits ids the model has no embedding row for.

    A model vocabulary larger than the tokenizer's is allowed: checkpoints often keep spare rows.
    """
    if tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError(
            f"tokenizer {tokenizer!r} has {tokenizer.vocab_size} ids but the model config's vocab_size is "
            f"{config.vocab_size}: ids >= {config.vocab_size} have no embedding; use the model's tokenizer "
            "or set vocab_size to the tokenizer's"
        )
