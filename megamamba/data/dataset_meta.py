"""What a dataset was made with and what it holds, recorded beside its `.idx` and checked before training.

`<prefix>.meta.json` names the tokenizer (token ids mean nothing without it), the .bin's id range
and its checksum; written under a temporary name and renamed. The record: docs/data.md ("The data code").
"""

import json
import os
import uuid
from typing import Optional

from megamamba.data.errors import DatasetError

META_SUFFIX = ".meta.json"
FORMAT, VERSION = "megamamba-dataset", 1


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def tokenizer_record(tokenizer, spec: str) -> dict:
    return {"name": spec, "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size}


def token_range_record(low: float, high: float, checksum: str) -> dict:
    """The "tokens" part: ids in [low, high] (stored as integers), for the .bin whose checksum (checksum.py) is
    `checksum`."""
    return {"checksum": checksum, "min_id": int(low), "max_id": int(high)}


def _write(prefix: str, record: dict) -> None:
    """Write the record whole under a temporary name of its own (processes on several hosts may write at
    once), then rename it into place; created as open() creates files, readable as the dataset is."""
    path = meta_path(prefix)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "x", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _read(prefix: str) -> Optional[dict]:
    """The whole record, None when there is none; DatasetError when it is not a readable record."""
    path = meta_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable dataset record ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise DatasetError(f"{path}: not a {FORMAT} record")
    return record


def write_meta(prefix: str, tokenizer, spec: str, tokens: Optional[dict] = None) -> None:
    """Write `<prefix>.meta.json`: the tokenizer, and the token range when given."""
    record = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_record(tokenizer, spec)}
    if tokens is not None:
        record["tokens"] = tokens
    _write(prefix, record)


def record_token_range(prefix: str, tokens: dict) -> None:
    """Set the "tokens" part of the record (creating the record if there is none), keeping the rest."""
    record = _read(prefix) or {"format": FORMAT, "version": VERSION}
    _write(prefix, {**record, "tokens": tokens})


def recorded_tokens(prefix: str) -> Optional[dict]:
    """The "tokens" part (ids "min_id" to "max_id" in the .bin whose checksum is "checksum"); None when the record
    has none, or one written before checksums were recorded."""
    record = _read(prefix)
    tokens = record.get("tokens") if record else None
    if not isinstance(tokens, dict) or not isinstance(tokens.get("checksum"), str):
        return None
    if not all(isinstance(tokens.get(k), int) for k in ("min_id", "max_id")):
        return None
    return tokens


def read_tokenizer_record(prefix: str) -> Optional[dict]:
    """The recorded tokenizer of a dataset, None when it has no record; DatasetError when malformed."""
    record = _read(prefix)
    if record is None or "tokenizer" not in record:
        return None
    tokenizer = record["tokenizer"]
    if not isinstance(tokenizer, dict) or not {"name", "identity", "vocab_size"} <= set(tokenizer):
        raise DatasetError(f"{meta_path(prefix)}: not a {FORMAT} record with tokenizer name, identity and vocab_size")
    return tokenizer


def _short(record: dict) -> str:
    return f"{record['name']!r} ({record['identity'][:19]}, {record['vocab_size']} ids)"


def check_tokenizer(prefix: str, tokenizer, spec: str, allow_mismatch: bool = False) -> Optional[str]:
    """None when `prefix` was made with `tokenizer`; else a warning (no record, or a mismatch allowed).

    DatasetError naming both tokenizers when they differ and `allow_mismatch` is off.
    """
    saved = read_tokenizer_record(prefix)
    if saved is None:
        return (
            f"{prefix}: no {META_SUFFIX} tokenizer record (made before records existed, or by another tool): "
            f"cannot check that it was made with --tokenizer {spec!r}; re-run preprocess to record it"
        )
    run = tokenizer_record(tokenizer, spec)
    if saved["identity"] == run["identity"]:
        return None
    mismatch = f"{prefix}: made with tokenizer {_short(saved)}, but --tokenizer is {_short(run)}"
    if allow_mismatch:
        return f"{mismatch}; training on it anyway (--allow-tokenizer-mismatch)"
    raise DatasetError(
        f"{mismatch}; train with the tokenizer it was made with, re-run preprocess with this one, or "
        "pass --allow-tokenizer-mismatch if this is deliberate"
    )
