"""A folder's set of tensors in safetensors files, read whole or as any rank's cut, never unpickled.

A set `stem` ("model", "optimizer") is `stem`.safetensors alone, or several files listed by
`stem`.safetensors.index.json (transformers' form: {"metadata": {"total_size"}, "weight_map":
{key: file}}). A key is a tensor's name, or, for a piece of a tensor that several ranks saved
each for itself, a key of its own whose record (megamamba.checkpoint.tensor_pieces.Piece) is in its file's
metadata under PIECES_KEY. `FolderTensors` reads headers only until asked for a tensor, then
reads just the bytes of the pieces the request overlaps.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from megamamba.checkpoint.tensor_pieces import Cut, Piece, assemble, check_cover
from megamamba.errors import MegamambaError

PIECES_KEY = "pieces"


class ModelFolderError(MegamambaError, ValueError):
    """A model folder that cannot be loaded; the message names the file or tensor."""


def shard_file(stem: str, index: int, count: int) -> str:
    """The file of shard `index` (0-based) of `count` of the tensor set `stem`: "model-00001-of-00002.safetensors"."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.safetensors"


def index_file(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def weight_map(directory: str, stem: str) -> dict:
    """Key -> file (in `directory`) of the tensor set `stem`: its shard index, else `stem`.safetensors alone."""
    return _read_index(directory, stem)[0]


def _read_index(directory: str, stem: str) -> tuple:
    """(key -> file, key -> record or None) of the tensor set `stem`; the records when its index carries them."""
    index = os.path.join(directory, index_file(stem))
    if not os.path.isfile(index):
        single = os.path.join(directory, f"{stem}.safetensors")
        try:
            with safe_open(single, framework="pt") as f:
                return dict.fromkeys(f.keys(), os.path.basename(single)), None
        except FileNotFoundError:
            raise ModelFolderError(f"{single}: no such file (nor {index_file(stem)})") from None
        except (SafetensorError, OSError) as e:
            raise ModelFolderError(f"{single}: not a readable safetensors file ({e})") from None
    try:
        with open(index, encoding="utf-8") as f:
            content = json.load(f)
        mapping, records = content.get("weight_map"), content.get(PIECES_KEY)
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFolderError(f"{index}: not a shard index ({e})") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) and os.sep not in v for v in mapping.values()):
        raise ModelFolderError(f"{index}: its weight_map is not {{tensor name: file in this folder}}")
    if records is not None and (not isinstance(records, dict) or set(records) != set(mapping)):
        raise ModelFolderError(f"{index}: its {PIECES_KEY!r} does not describe exactly the tensors of its weight_map")
    return mapping, records


def index_record(key: str, shape: Sequence[int], record: Optional[dict]) -> dict:
    """The index's record of a stored tensor: its piece record, or {name, shape} for a whole tensor."""
    return record if record is not None else {"name": key, "shape": list(shape)}


class FolderTensors(contextlib.ExitStack):
    """The tensor set `stem` of `directory` by tensor name (pieces put together); use it as a context manager.

    Opening reads the index's records when it has them (a checkpoint's: no file is opened until a
    tensor is read, and then only the files holding the pieces asked for), else every file's
    header; each piece's record is checked, and with `check=True` that every tensor's pieces hold
    each of its elements exactly once.
    """

    def __init__(self, directory: str, stem: str, check: bool = False):
        super().__init__()
        self.directory, self.stem = directory, stem
        self._handles: dict = {}
        self.stored: dict[str, list] = {}  # name -> [(piece, file, key)]; piece None: a 0-d tensor, whole
        mapping, records = _read_index(directory, stem)
        by_file: dict[str, list] = {}
        for key, file in mapping.items():
            by_file.setdefault(file, []).append(key)
        try:
            for file, keys in sorted(by_file.items()):
                if records is None:
                    self._add_file(file, keys)
                else:
                    for key in keys:
                        self._add(key, file, records[key], None, os.path.join(directory, index_file(stem)))
            if check:
                for name, stored in self.stored.items():
                    pieces = [piece for piece, _, _ in stored]
                    if None in pieces and len(pieces) > 1:
                        raise ValueError(f"{name}: a 0-d tensor stored {len(pieces)} times")
                    if None not in pieces:
                        check_cover(name, pieces)
        except ModelFolderError:
            self.close()
            raise
        except ValueError as e:
            self.close()
            raise ModelFolderError(f"{os.path.join(directory, stem)}: {e}") from None

    def _handle(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            try:
                self._handles[file] = self.enter_context(safe_open(path, framework="pt"))
            except FileNotFoundError:
                raise ModelFolderError(f"{path}: no such file") from None
            except (SafetensorError, OSError) as e:
                raise ModelFolderError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def _add_file(self, file: str, keys: list) -> None:
        f = self._handle(file)
        path = os.path.join(self.directory, file)
        absent = sorted(set(keys) - set(f.keys()))
        if absent:
            raise ModelFolderError(f"{path}: has no tensors {absent[:5]}, which its index names")
        try:
            records = json.loads((f.metadata() or {}).get(PIECES_KEY, "{}"))
        except ValueError as e:
            raise ModelFolderError(f"{path}: its {PIECES_KEY!r} metadata is not JSON ({e})") from None
        for key in keys:
            shape = tuple(f.get_slice(key).get_shape())
            self._add(key, file, index_record(key, shape, records.get(key)), shape, path)

    def _add(self, key: str, file: str, record: dict, stored_shape: Optional[tuple], where: str) -> None:
        """Note the tensor stored under `key` in `file` from its record (checked against `stored_shape` when known)."""
        if "dim" in record:
            piece = Piece.from_record(record, f"{where}: {key}")
        else:
            try:
                shape = tuple(int(n) for n in record["shape"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{where}: {key}: record {record!r} is neither a piece nor {{name, shape}}") from None
            piece = Piece(key, shape, Cut.whole(shape)) if shape else None
        expected = piece.stored_shape if piece is not None else ()
        if stored_shape is not None and stored_shape != expected:
            raise ValueError(f"{where}: {key} has shape {stored_shape}, its record says {expected}")
        self.stored.setdefault(piece.name if piece is not None else key, []).append((piece, file, key))

    def names(self) -> list:
        return sorted(self.stored)

    def shape(self, name: str) -> tuple:
        piece, _, _ = self._stored(name)[0]
        return piece.shape if piece is not None else ()

    def dtype(self, name: str) -> str:
        """safetensors' name of the stored dtype ("F32", "BF16", ...)."""
        _, file, key = self._stored(name)[0]
        return self._handle(file).get_slice(key).get_dtype()

    def _stored(self, name: str) -> list:
        if name not in self.stored:
            raise ModelFolderError(f"{os.path.join(self.directory, self.stem)}: has no tensor {name!r}")
        return self.stored[name]

    def read(self, name: str, cut: Optional[Cut] = None) -> torch.Tensor:
        """The full tensor `name`, or its local tensor `cut` (padding rows zero), on the CPU."""
        stored = self._stored(name)
        piece, file, key = stored[0]
        if piece is None:
            return self._handle(file).get_tensor(key)

        def reader(piece: Piece, file: str, key: str):
            def read(dim: int, start: int, stop: int) -> torch.Tensor:
                sliced = self._handle(file).get_slice(key)
                if tuple(sliced.get_shape()) != piece.stored_shape:
                    raise ModelFolderError(
                        f"{os.path.join(self.directory, file)}: {key} has shape "
                        f"{tuple(sliced.get_shape())}, its record says {piece.stored_shape}"
                    )
                return sliced[(slice(None),) * dim + (slice(start, stop),)]

            return read

        try:
            return assemble([(p, reader(p, f, k)) for p, f, k in stored], cut or Cut.whole(piece.shape))
        except ModelFolderError:
            raise
        except ValueError as e:  # the stored pieces cannot give this cut
            raise ModelFolderError(f"{os.path.join(self.directory, self.stem)}: {name}: {e}") from None

    def read_all(self, names: Optional[Iterable[str]] = None) -> dict:
        """Full tensors by name (all, or `names`)."""
        return {n: self.read(n) for n in (self.names() if names is None else sorted(set(names)))}


def read_folder_tensors(directory: str, stem: str, names: Optional[Iterable[str]] = None) -> dict:
    """The full tensors of the set `stem` (all, or `names`), on the CPU."""
    with FolderTensors(directory, stem) as tensors:
        return tensors.read_all(names)
