"""Tokenizers behind one small interface (`base.Tokenizer`): bytes, SentencePiece, HF tokenizer.json.

    from megamamba.tokenizer import load_tokenizer, train_sentencepiece, check_vocab
    tok = load_tokenizer("data/spm.model")   # or "bytes", a tokenizer.json, a model folder
    tok.encode(text), tok.decode(ids), tok.vocab_size, tok.eod, tok.save(folder)

Train a SentencePiece model from the command line: `python -m megamamba.tokenizer.train`.
"""

from megamamba.tokenizer.base import Bytes, Tokenizer, TokenizerError
from megamamba.tokenizer.hf_json import HFTokenizer
from megamamba.tokenizer.load import find_tokenizer, load_tokenizer
from megamamba.tokenizer.sentencepiece_model import SentencePieceTokenizer, train_sentencepiece
from megamamba.tokenizer.vocab import check_vocab, config_with_vocab

__all__ = [
    "Bytes",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "check_vocab",
    "config_with_vocab",
    "find_tokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]
