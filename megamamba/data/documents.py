"""Input documents for tokenizer training and preprocessing, in a fixed order.

An input path is one of: a JSONL file (`.jsonl`/`.json`; one document per line, the text under
a key), a text file of any other extension (the whole file is one document), or a folder (its
`.txt` and `.jsonl` files, recursively, sorted by relative path). Paths keep the order given.
Each document comes with the number of input bytes it used, for progress and rate displays.
Input must be UTF-8: invalid bytes are refused with file, line and byte offset, for every input
kind alike, unless the caller asks for replacement (then U+FFFD, reported once per file).
"""

import json
import os
import sys
from typing import Iterator, Optional, Sequence

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


class Utf8Decoder:
    """UTF-8 text of one input file's bytes: invalid bytes refused with the file, line and byte offset,
    or (replace=True) replaced with U+FFFD and reported once per file on stderr."""

    def __init__(self, path: str, replace: bool):
        self.path, self.replace, self.replaced, self.first = path, replace, 0, None

    def decode(self, data: bytes, line: Optional[int], offset: int) -> str:
        """`data` starts at byte `offset` of the file; `line`: its line number (None: count from the file start)."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = line if line is not None else data.count(b"\n", 0, e.start) + 1
            where = f"{self.path}:{line}: invalid UTF-8 at byte offset {offset + e.start} ({e.reason})"
            if not self.replace:
                raise ValueError(
                    f"{where}; fix the input, or pass --replace-invalid-utf8 to replace invalid bytes with U+FFFD"
                ) from None
            self.replaced += 1
            self.first = self.first or where
            return data.decode("utf-8", errors="replace")

    def report(self) -> None:
        if self.replaced:
            print(
                f"warning: {self.first}: replaced with U+FFFD (--replace-invalid-utf8), in {self.replaced} "
                f"{'line' if self.path.endswith(JSONL_SUFFIXES) else 'document'}(s) of this file",
                file=sys.stderr,
                flush=True,
            )


def _jsonl_documents(path: str, json_key: str, decoder: Utf8Decoder) -> Iterator[tuple[str, int]]:
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line, start = decoder.decode(raw, number, offset), offset
            offset += len(raw)
            if not line.strip():
                yield "", len(raw)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg}, byte offset {start + e.pos})") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{path}:{number}: no key {json_key!r} (choose it with --json-key)")
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: {json_key!r} holds {type(text).__name__}, not text")
            yield text, len(raw)


def iter_documents(
    files: Sequence[str], json_key: str = "text", replace_invalid_utf8: bool = False
) -> Iterator[tuple[str, int]]:
    """(document text, input bytes it used) for every document of `files`, in order; blank ones included.

    Invalid UTF-8 raises ValueError naming the file, line and byte offset, whatever the input kind;
    replace_invalid_utf8 replaces it with U+FFFD instead and says so on stderr, once per file.
    """
    for path in files:
        decoder = Utf8Decoder(path, replace_invalid_utf8)
        if path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(path, json_key, decoder)
        else:
            with open(path, "rb") as f:
                raw = f.read()
            yield decoder.decode(raw, None, 0), len(raw)
        decoder.report()


def total_bytes(files: Sequence[str]) -> int:
    return sum(os.path.getsize(f) for f in files)
