"""The packer's per-epoch arrays of a large dataset, built once and memory-mapped by every rank.

About 24 bytes per document per rank otherwise; the first process to lock the folder builds an
epoch's files, the others wait and map them. Details: docs/data.md ("The data code").
"""

import os
from typing import Callable, Optional

import numpy as np

from megamamba.data.file_lock import exclusive_lock
from megamamba.data.indexed import IndexedDataset
from megamamba.data.split import DocumentRange

INDEX_DOCUMENTS = 1 << 20  # datasets with fewer documents keep their epoch arrays in memory (< 25 MB)
NAMES = ("order", "starts", "samples")

EpochArrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def index_base(dataset, seed: int, key: int, seq_length: int, epoch: int) -> Optional[str]:
    """Path stem of the epoch's files (None: not kept on disk): the dataset's index file as it is now
    (size and modification time: a rewritten dataset gets new files), the documents it covers and
    every input of the arrays."""
    if dataset.num_documents < INDEX_DOCUMENTS:
        return None
    if isinstance(dataset, IndexedDataset):
        prefix, documents = dataset.prefix, f"{dataset.num_documents}docs"
    elif isinstance(dataset, DocumentRange) and isinstance(dataset.source, IndexedDataset):
        prefix, documents = dataset.source.prefix, f"docs{dataset.first}-{dataset.stop}"
    else:
        return None
    index = os.stat(prefix + ".idx")
    name = (
        f"idx{index.st_size}-{index.st_mtime_ns}-{documents}-{dataset.num_tokens}tokens-seq{seq_length}-"
        f"seed{seed}-key{key}-epoch{epoch}"
    )
    return os.path.join(prefix + ".epochs", name)


def _load(base: str, sizes: tuple[int, int, int]) -> Optional[EpochArrays]:
    """The mapped files, or None where one is missing, unreadable or of another length."""
    try:
        arrays = tuple(np.load(f"{base}.{name}.npy", mmap_mode="r") for name in NAMES)
    except (OSError, ValueError):
        return None
    return arrays if tuple(a.shape for a in arrays) == tuple((n,) for n in sizes) else None


def _save(base: str, arrays: EpochArrays) -> None:
    for name, array in zip(NAMES, arrays):
        tmp = f"{base}.{name}.tmp.{os.getpid()}.npy"
        np.save(tmp, array)
        os.replace(tmp, f"{base}.{name}.npy")


def epoch_arrays(base: Optional[str], sizes: tuple[int, int, int], build: Callable[[], EpochArrays]) -> EpochArrays:
    """The epoch's arrays (of lengths `sizes`): built in memory (base None or not writable), or
    mapped from `base`'s files, which the first process to get the folder's lock builds."""
    if base is None:
        return build()
    folder = os.path.dirname(base)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return build()
    with exclusive_lock(os.path.join(folder, ".lock")):  # without locks, every process builds the same files
        found = _load(base, sizes)
        if found is not None:
            return found
        arrays = build()
        try:
            _save(base, arrays)
        except OSError:
            return arrays
    return _load(base, sizes) or arrays
