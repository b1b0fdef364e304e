"""A SentencePiece model rebuilt with the `tokenizers` library, to encode and decode as SentencePiece does.

transformers reads `tokenizer.json`, not `.model` files, so an export describes SentencePiece's
normalisation, pieces, model, byte fallback and decoding in that library's terms (docs/checkpoints.md);
`TokenizerError` names a model option that cannot be expressed.
"""

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Regex, decoders, models, normalizers
from tokenizers import Tokenizer as Library

from megamamba.tokenizer.base import TokenizerError

SPACE = "▁"
Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
ModelType = sentencepiece_model_pb2.TrainerSpec.ModelType
# Far below any real log-probability, so a unigram segmentation never uses such a piece while another exists.
NEVER_MATCHED_SCORE = -1e6


def read_model(path: str) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _refuse_inexpressible(path: str, proto) -> None:
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.model_type not in (ModelType.BPE, ModelType.UNIGRAM):
        raise TokenizerError(
            f"{path}: model_type={ModelType.Name(spec.model_type)}: only BPE and UNIGRAM "
            "SentencePiece models convert to tokenizer.json"
        )
    if spec.treat_whitespace_as_suffix:
        raise TokenizerError(f"{path}: treat_whitespace_as_suffix=true has no tokenizer.json equivalent")
    if proto.denormalizer_spec.precompiled_charsmap:
        raise TokenizerError(f"{path}: a denormalizer (decode-time character map) has no tokenizer.json equivalent")
    if norm.add_dummy_prefix and any(p.type == Piece.USER_DEFINED for p in proto.pieces):
        raise TokenizerError(
            f"{path}: add_dummy_prefix=true with user-defined pieces: tokenizer.json prepends the "
            "dummy '▁' to every span between them, SentencePiece once"
        )


def _normalizer(proto):
    norm = proto.normalizer_spec
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps) if steps else None


def _bpe_merges(proto) -> list:
    """Every (left, right) of normal pieces that makes a normal piece, the highest-scoring result first."""
    normal = {p.piece: (i, p.score) for i, p in enumerate(proto.pieces) if p.type == Piece.NORMAL}
    merges = []
    for piece, (index, score) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-score, index, normal[left][0], (left, right)))
    return [pair for *_, pair in sorted(merges)]


def _model(proto):
    spec = proto.trainer_spec
    unk = proto.pieces[spec.unk_id].piece
    if spec.model_type == ModelType.BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        return models.BPE(
            vocab=vocab, merges=_bpe_merges(proto), unk_token=unk, byte_fallback=spec.byte_fallback, fuse_unk=True
        )
    matched = (Piece.NORMAL, Piece.USER_DEFINED)
    vocab = [(p.piece, p.score if p.type in matched else NEVER_MATCHED_SCORE) for p in proto.pieces]
    return models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)


def _decoder(proto):
    """SentencePiece's decoding, but control pieces (`</s>`) keep their text (skip_special_tokens drops them)."""
    spec = proto.trainer_spec
    steps = [decoders.Replace(proto.pieces[spec.unk_id].piece, spec.unk_surface)]
    steps += [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def special_pieces(proto) -> dict:
    """transformers' names of the model's special pieces: {"eos_token": "</s>", "unk_token": "<unk>", ...}."""
    spec = proto.trainer_spec
    ids = {"unk_token": spec.unk_id, "bos_token": spec.bos_id, "eos_token": spec.eos_id, "pad_token": spec.pad_id}
    return {name: proto.pieces[i].piece for name, i in ids.items() if i >= 0}


def sentencepiece_as_tokenizers(path: str) -> Library:
    """The `tokenizers` tokenizer equal to the SentencePiece model at `path` (see the module docstring)."""
    proto = read_model(path)
    _refuse_inexpressible(path, proto)
    tok = Library(_model(proto))
    tok.normalizer = _normalizer(proto)
    tok.decoder = _decoder(proto)
    special = (Piece.CONTROL, Piece.UNKNOWN)
    tok.add_special_tokens(
        [AddedToken(p.piece, special=True, normalized=False) for p in proto.pieces if p.type in special]
    )
    tok.add_tokens([AddedToken(p.piece, normalized=False) for p in proto.pieces if p.type == Piece.USER_DEFINED])
    return tok
