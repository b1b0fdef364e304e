"""Small corpora and datasets for the data tests (helpers importable as `data_fixtures`)."""

import json
import os

import numpy as np
import pytest

from megamamba.data.indexed import IndexedDatasetWriter

EOD = 0


def write_dataset(prefix: str, documents, dtype=np.uint16) -> str:
    """A .bin/.idx pair holding `documents` (lists of ids) as they are."""
    writer = IndexedDatasetWriter(prefix, np.dtype(dtype))
    for doc in documents:
        writer.add_document(np.asarray(doc, dtype=dtype))
    writer.finalize()
    return prefix


def corrupt_in_place(path: str, token: int, value: int, dtype=np.uint16) -> None:
    """Overwrite one token of a .bin, keeping the file's size and modification time."""
    stat = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(token * np.dtype(dtype).itemsize)
        f.write(np.array([value], dtype).tobytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (os.path.getsize(path), os.stat(path).st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def labelled_documents(count: int, seed: int, first_label: int = 1, min_len: int = 1, max_len: int = 30):
    """Documents whose tokens all equal the document's label (first_label, first_label + 1, ...), then EOD."""
    rng = np.random.default_rng(seed)
    return [[first_label + d] * int(rng.integers(min_len, max_len + 1)) + [EOD] for d in range(count)]


TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nIt was the best of times, it was the worst of times.",
    "def main():\n    print('hello, world')\n\treturn 0\n",
    "Unicode: naïve café, 漢字, snowman ☃ and an emoji 🙂.",
    "",
    "  leading spaces and trailing  \n\n\nblank lines",
    "Numbers 12345 and 3.14159 and 2**32 = 4294967296.",
]


@pytest.fixture
def corpus_jsonl(tmp_path):
    """A JSONL corpus of varied documents (one empty), repeated for volume."""
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            for text in TEXTS:
                f.write(json.dumps({"text": f"{i} {text}" if text else ""}) + "\n")
    return str(path)
