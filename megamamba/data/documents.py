"""Input documents for tokenizer training and preprocessing, in a fixed order.

An input path is one of: a JSONL file (`.jsonl`/`.json`; one document per line, the text under
a key), a text file of any other extension (the whole file is one document), or a folder (its
`.txt` and `.jsonl` files, recursively, sorted by relative path). Paths keep the order given.
Each document comes with the number of input bytes it used, for progress and rate displays.
"""
import json
import os
from typing import Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json")
FOLDER_SUFFIXES = (".txt",) + JSONL_SUFFIXES


def input_files(paths: Sequence[str]) -> list[str]:
    """Expand folders into their text and JSONL files; every path must exist and the list must not end up empty."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, n) for n in names if n.endswith(FOLDER_SUFFIXES)]
            if not found:
                raise FileNotFoundError(f"input folder {path!r} holds no {'/'.join(FOLDER_SUFFIXES)} files")
            files += sorted(found, key=lambda f: os.path.relpath(f, path))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path!r}: no such file or folder")
    if not files:
        raise ValueError("no input files given")
    return files


def _jsonl_documents(path: str, json_key: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                yield "", len(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{path}:{number}: no key {json_key!r} (choose it with --json-key)")
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: {json_key!r} holds {type(text).__name__}, not text")
            yield text, len(line)


def iter_documents(files: Sequence[str], json_key: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes it used) for every document of `files`, in order; blank ones included."""
    for path in files:
        if path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(path, json_key)
        else:
            with open(path, "rb") as f:
                raw = f.read()
            yield raw.decode("utf-8", errors="replace"), len(raw)


def total_bytes(files: Sequence[str]) -> int:
    return sum(os.path.getsize(f) for f in files)
