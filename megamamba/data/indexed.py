"""Token datasets in Megatron-LM's memory-mapped indexed-dataset layout (`.bin` + `.idx`).

Datasets made here load in Megatron and Megatron's text datasets load here; reading validates
everything it relies on and names the file and the rule a corrupt, truncated or empty dataset
breaks. The `.idx` layout: docs/data.md ("The data code").
"""

import math
import os
import struct
from array import array
from typing import Optional

import numpy as np

from megamamba.data.checksum import Checksum
from megamamba.data.errors import DatasetError
from megamamba.data.vocab_check import check_vocab

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_CHECK_SEQUENCES = 1 << 20  # index entries per chunk when checking an index


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while every id fits (vocab below 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetWriter:
    """Append documents to `<prefix>.bin`, then `finalize()` writes `<prefix>.idx`.

    Both files are written under temporary names and renamed at the end, so an interrupted
    run never leaves a pair that looks complete. `finalize()` is `close()` (both files complete
    under their temporary names) then `commit()` (renamed into place); between the two, a record
    of the finished .bin can be written beside it first (preprocess.py). `low` and `high` are the
    smallest and largest id added (inf and -inf before any), `checksum` the .bin's so far (checksum.py).
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no code in the indexed-dataset layout")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self.lengths = array("q")
        self.low, self.high = math.inf, -math.inf
        self.checksum = Checksum()

    def abort(self) -> None:
        """Close and remove the temporary files; nothing under the final names is touched."""
        self._bin.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            if os.path.exists(self.prefix + suffix):
                os.remove(self.prefix + suffix)

    def add_document(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            raise ValueError(f"document tokens are {tokens.dtype}, the dataset stores {self.dtype}")
        if tokens.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {tokens.size} tokens: the index stores lengths as int32")
        data = tokens.tobytes(order="C")
        self._bin.write(data)
        self.checksum.update(data)
        self.lengths.append(tokens.size)
        if tokens.size:
            self.low, self.high = min(self.low, int(tokens.min())), max(self.high, int(tokens.max()))

    def finalize(self) -> None:
        self.close()
        self.commit()

    def close(self) -> None:
        """Finish both files under their temporary names."""
        self._bin.close()
        count = len(self.lengths)
        lengths = np.array(self.lengths, dtype=np.int32)
        pointers = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(count + 1, dtype=np.int64)
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], count, count + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())

    def commit(self) -> None:
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")


class IndexedDataset:
    """A read-only, memory-mapped dataset of documents.

    `tokens` is the whole .bin as one array; document d is tokens[offsets[d]:offsets[d+1]].
    With `vocab_size`, the .bin's content is checked against its recorded checksum and every token
    to lie in [0, vocab_size), or the .bin is scanned once and both recorded (vocab_check.py);
    `warning` is that check's reservation (None without one, or without `vocab_size`).
    """

    def __init__(self, prefix: str, vocab_size: Optional[int] = None):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DatasetError(f"{path}: no such file (a dataset is the pair {prefix}.bin and {prefix}.idx)")
        self.dtype, self.offsets = self._read_index(idx_path)
        self.num_tokens = int(self.offsets[-1])
        if self.offsets.size < 2 or self.num_tokens == 0:
            raise DatasetError(f"{prefix}: empty dataset ({self.offsets.size - 1} documents, {self.num_tokens} tokens)")
        expected = self.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            what = "truncated" if actual < expected else "longer than its index says"
            raise DatasetError(
                f"{bin_path}: {what}: {actual} bytes, the index describes {expected} "
                f"({self.num_tokens} tokens of {self.dtype})"
            )
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")
        self.warning = check_vocab(self, vocab_size) if vocab_size is not None else None

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    def document(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d] : self.offsets[d + 1]]

    def locate(self, position: int) -> str:
        """Where `tokens[position]` is, for messages: the file, the token and its document."""
        document = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return f"{self.prefix}.bin, token {position} (document {document})"

    def _read_index(self, path: str) -> tuple[np.dtype, np.ndarray]:
        """(token dtype, token offset of every document and the total) from the memory-mapped index."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            if MAGIC.startswith(head[: len(MAGIC)]):
                raise DatasetError(f"{path}: truncated: {size} bytes, shorter than the {_HEADER.size}-byte header")
            raise DatasetError(f"{path}: not an indexed-dataset index (no {MAGIC!r} header)")
        magic, version, code, count, doc_count = _HEADER.unpack(head)
        if magic != MAGIC:
            raise DatasetError(f"{path}: not an indexed-dataset index: starts with {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise DatasetError(f"{path}: index version {version}; only version {VERSION} is known")
        if code not in DTYPE_CODES:
            raise DatasetError(f"{path}: unknown token dtype code {code}; known: {sorted(DTYPE_CODES)}")
        dtype = np.dtype(DTYPE_CODES[code])
        if dtype.kind not in "iu":
            raise DatasetError(f"{path}: token dtype {dtype} is not an integer type")
        body = _HEADER.size + 12 * count + 8 * doc_count
        if size not in (body, body + count):  # + count: a multimodal index's sequence modes
            what = "truncated" if size < body else "has trailing bytes"
            raise DatasetError(
                f"{path}: {what}: {size} bytes, its header ({count} sequences, "
                f"{doc_count} document-index entries) implies {body}"
            )
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        lengths = np.ndarray((count,), np.int32, raw, _HEADER.size)
        pointers = np.ndarray((count,), np.int64, raw, _HEADER.size + 4 * count)
        documents = np.ndarray((doc_count,), np.int64, raw, _HEADER.size + 12 * count)
        self._check_index(path, dtype, lengths, pointers, documents)
        total = int(pointers[-1]) // dtype.itemsize + int(lengths[-1]) if count else 0
        offsets = np.empty(doc_count, dtype=np.int64)  # token offset of each document's first sequence
        for first in range(0, doc_count, _CHECK_SEQUENCES):
            sequences = documents[first : first + _CHECK_SEQUENCES]
            chunk = offsets[first : first + sequences.size]
            inside = sequences < count
            chunk[inside] = pointers[sequences[inside]] // dtype.itemsize
            chunk[~inside] = total
        return dtype, offsets

    @staticmethod
    def _check_index(path, dtype, lengths, pointers, documents) -> None:
        """Lengths non-negative, pointers where the sequences before end, documents from 0 up to the sequence
        count; checked in chunks, so the check's own memory stays small on any index."""
        end = 0  # byte where the sequences checked so far end
        for first in range(0, lengths.size, _CHECK_SEQUENCES):
            chunk = lengths[first : first + _CHECK_SEQUENCES].astype(np.int64)
            if (chunk < 0).any():
                raise DatasetError(
                    f"{path}: corrupt: negative sequence length at sequence {first + int(np.argmax(chunk < 0))}"
                )
            starts = np.empty(chunk.size, dtype=np.int64)
            starts[0] = end
            np.cumsum(chunk[:-1] * dtype.itemsize, out=starts[1:])
            starts[1:] += end
            bad = np.flatnonzero(pointers[first : first + chunk.size] != starts)
            if bad.size:
                s = first + int(bad[0])
                raise DatasetError(
                    f"{path}: corrupt: sequence {s} points to byte {pointers[s]}, "
                    f"but the sequences before it end at byte {starts[bad[0]]}"
                )
            end = int(starts[-1]) + int(chunk[-1]) * dtype.itemsize
        if documents.size == 0 or documents[0] != 0 or documents[-1] != lengths.size:
            raise DatasetError(
                f"{path}: corrupt: the document index must run from 0 to the {lengths.size} sequences, "
                f"got {documents[:1].tolist()} ... {documents[-1:].tolist()}"
            )
        for first in range(0, documents.size, _CHECK_SEQUENCES):
            if (np.diff(documents[first : first + _CHECK_SEQUENCES + 1]) < 0).any():
                raise DatasetError(f"{path}: corrupt: the document index decreases")
