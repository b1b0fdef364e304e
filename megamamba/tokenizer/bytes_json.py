"""The byte tokenizer (`base.Bytes`) built with the `tokenizers` library, for transformers.

Ids 0..255 are the UTF-8 bytes and 256 the end-of-document token, named "<|endoftext|>" here
(ours has no names). A byte-level pre-tokenizer turns every byte into one printable character
(GPT-2's alphabet) and a model without merges gives each its byte's id; decoding joins the bytes
and replaces invalid UTF-8 with U+FFFD as Python's errors="replace" does. The end-of-document
token decodes to its name, as transformers users expect of a special token (lm-eval stops
generating at it); `skip_special_tokens=True` drops it, as `Bytes.decode` does.
"""

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Library

from megamamba.tokenizer.base import Bytes, TokenizerError

EOD_TOKEN = "<|endoftext|>"
# Bytes that print as themselves in GPT-2's byte-level alphabet; the others map, in order, to U+0100 onwards.
_PRINTABLE = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))


def byte_alphabet() -> list:
    """The byte-level character of each byte 0..255."""
    chars, shifted = [], 0
    for byte in range(256):
        if byte in _PRINTABLE:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def bytes_as_tokenizers() -> Library:
    """The `tokenizers` tokenizer with Bytes' ids (see the module docstring)."""
    tok = Library(models.BPE(vocab={c: i for i, c in enumerate(byte_alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    eod = tok.token_to_id(EOD_TOKEN)
    if eod != Bytes.eod:
        raise TokenizerError(f"tokenizers gave {EOD_TOKEN} id {eod}, not Bytes' end-of-document id {Bytes.eod}")
    return tok
