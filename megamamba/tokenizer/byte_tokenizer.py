"""Byte-level tokenizer: UTF-8 bytes are the tokens 0..255, plus an end-of-document token."""


class ByteTokenizer:
    """Lossless for any text and needs no training; 257 tokens (256 bytes + end of document)."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
