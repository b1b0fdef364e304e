"""SentencePiece tokenizers: train one from documents (reproducibly) and load `.model` files.

Lossless settings (decode(encode(text)) == text), a byte-identical `.model` from the same input,
and unigram scores on a 1/64 grid so transformers breaks ties as SentencePiece does: docs/data.md.
"""

import hashlib
import io
import os
import shutil
from typing import Iterable

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from megamamba.tokenizer.base import TokenizerError

MODEL_FILE = "tokenizer.model"
MODEL_TYPES = ("bpe", "unigram")
TRAIN_THREADS = 4
# 256 byte pieces + <unk> + </s> + "\n": below this SentencePiece has no room for merges.
MIN_VOCAB_SIZE = 260
UNIGRAM_SCORE_STEP = 1 / 64


class SentencePieceTokenizer:
    """A loaded SentencePiece model; `path` is the `.model` file it came from."""

    def __init__(self, path: str):
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a readable SentencePiece model ({e})") from None
        self.vocab_size = self._sp.get_piece_size()
        with open(path, "rb") as f:  # save() copies the file, so the copy has the same identity
            self.identity = "sha256:" + hashlib.sha256(f.read()).hexdigest()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(
                f"{path}: the SentencePiece model has no end-of-sentence piece (eos_id=-1); "
                "it is needed as the end-of-document token"
            )

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def save(self, directory: str) -> None:
        shutil.copyfile(self.path, os.path.join(directory, MODEL_FILE))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _lines(documents: Iterable[str]) -> Iterable[str]:
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line


def model_path(output_prefix: str) -> str:
    """The file `train_sentencepiece` writes for `output_prefix`."""
    return output_prefix + ".model"


def train_sentencepiece(
    documents: Iterable[str],
    output_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    seed: int = 0,
    threads: int = TRAIN_THREADS,
    character_coverage: float = 0.9995,
    max_sentences: int = 0,
) -> str:
    """Train on the documents' non-blank lines; write `<output_prefix>.model` and return its path.

    max_sentences > 0 trains on a seeded random sample of that many lines (large corpora).
    """
    if model_type not in MODEL_TYPES:
        raise TokenizerError(f"model type {model_type!r}: choose one of {MODEL_TYPES}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab size {vocab_size!r}: must be an integer >= {MIN_VOCAB_SIZE} "
            "(256 byte pieces + <unk>, </s> and newline)"
        )
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    failures = []

    def sentences():  # an error of the documents (e.g. invalid UTF-8) is raised as it is, after SentencePiece
        try:  # returns: raised inside, it becomes SentencePiece's RuntimeError with a traceback text
            yield from _lines(documents)
        except Exception as e:  # noqa: BLE001 - re-raised below
            failures.append(e)

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            unk_id=0,
            eos_id=1,
            bos_id=-1,
            pad_id=-1,
            num_threads=threads,
            max_sentence_length=1 << 16,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=max_sentences > 0,
            minloglevel=2,
        )
    except RuntimeError as e:
        if failures:
            raise failures[0] from None
        raise TokenizerError(f"SentencePiece training failed: {e}") from None
    if failures:
        raise failures[0]
    path = model_path(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(_on_score_grid(model.getvalue()) if model_type == "unigram" else model.getvalue())
    return path


def _on_score_grid(model: bytes) -> bytes:
    """The unigram model with every score rounded to a multiple of UNIGRAM_SCORE_STEP (module docstring)."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    for piece in proto.pieces:
        piece.score = round(piece.score / UNIGRAM_SCORE_STEP) * UNIGRAM_SCORE_STEP
    return proto.SerializeToString()
