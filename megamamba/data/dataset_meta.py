"""The tokenizer a dataset was made with, recorded beside its `.idx` and checked before training.

    <prefix>.meta.json   {"format": "megamamba-dataset", "version": 1,
                          "tokenizer": {"name": spec given to preprocess, "identity": tokenizer.identity,
                                        "vocab_size": ...}}

Token ids mean nothing without their tokenizer, and data made with another one trains without
any error as long as its ids fit the vocabulary. Preprocessing writes this record; training
refuses a dataset whose tokenizer differs from the run's (unless told to allow it), and accepts
datasets made before records existed (or by Megatron) with a warning.
"""
import json
import os
from typing import Optional

from megamamba.data.indexed import DatasetError

META_SUFFIX = ".meta.json"
FORMAT, VERSION = "megamamba-dataset", 1


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def tokenizer_record(tokenizer, spec: str) -> dict:
    return {"name": spec, "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size}


def write_meta(prefix: str, tokenizer, spec: str) -> None:
    """Write `<prefix>.meta.json` (under a temporary name first, so it is whole or absent)."""
    record = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_record(tokenizer, spec)}
    tmp = meta_path(prefix) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, meta_path(prefix))


def read_tokenizer_record(prefix: str) -> Optional[dict]:
    """The recorded tokenizer of a dataset, None when it has no record; DatasetError when malformed."""
    path = meta_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable dataset record ({e})") from None
    tokenizer = record.get("tokenizer") if isinstance(record, dict) else None
    if record.get("format") != FORMAT or not isinstance(tokenizer, dict) or \
            not {"name", "identity", "vocab_size"} <= set(tokenizer):
        raise DatasetError(f"{path}: not a {FORMAT} record with tokenizer name, identity and vocab_size")
    return tokenizer


def _short(record: dict) -> str:
    return f"{record['name']!r} ({record['identity'][:19]}, {record['vocab_size']} ids)"


def check_tokenizer(prefix: str, tokenizer, spec: str, allow_mismatch: bool = False) -> Optional[str]:
    """None when `prefix` was made with `tokenizer`; else a warning (no record, or a mismatch allowed).

    DatasetError naming both tokenizers when they differ and `allow_mismatch` is off.
    """
    saved = read_tokenizer_record(prefix)
    if saved is None:
        return (f"{prefix}: no {META_SUFFIX} tokenizer record (made before records existed, or by another tool): "
                f"cannot check that it was made with --tokenizer {spec!r}; re-run preprocess to record it")
    run = tokenizer_record(tokenizer, spec)
    if saved["identity"] == run["identity"]:
        return None
    mismatch = f"{prefix}: made with tokenizer {_short(saved)}, but --tokenizer is {_short(run)}"
    if allow_mismatch:
        return f"{mismatch}; training on it anyway (--allow-tokenizer-mismatch)"
    raise DatasetError(f"{mismatch}; train with the tokenizer it was made with, re-run preprocess with this one, or "
                       "pass --allow-tokenizer-mismatch if this is deliberate")
