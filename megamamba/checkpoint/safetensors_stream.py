"""safetensors read and written one tensor at a time, sharded above a size limit as transformers shards.

`TensorReader` loads one tensor per call from a folder's set; `write_sharded` writes headers
first, then each tensor as it is loaded, so it holds one tensor, never a shard. Sharding and file
layout rules: docs/checkpoints.md ("Converting to and from Hugging Face and mamba_ssm").
"""

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megamamba.checkpoint.finite import check_finite
from megamamba.checkpoint.folder_tensors import FolderTensors, ModelFolderError, index_file, shard_file
from megamamba.checkpoint.model_folder import WEIGHTS_STEM

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * DTYPES[self.dtype].itemsize


def parse_size(text) -> int:
    """Bytes of a size as transformers writes it: 5GB (10**9), 4GiB (2**30), 500MB, or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) * _UNITS[match.group(2)] < 1:
        raise ValueError(
            f"size {text!r}: expected a positive byte count or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class TensorReader(FolderTensors):
    """The full tensors of a folder's weights (pieces put together): specs from the headers, `load(name)`
    one at a time, checked finite; use it as a context manager."""

    def __init__(self, directory: str):
        super().__init__(directory, WEIGHTS_STEM)

    def spec(self, name: str) -> TensorSpec:
        dtype = self.dtype(name)
        if dtype not in DTYPES:
            raise ModelFolderError(
                f"{os.path.join(self.directory, WEIGHTS_STEM)}: {name} has dtype {dtype}, not one of {sorted(DTYPES)}"
            )
        return TensorSpec(name, dtype, self.shape(name))

    def load(self, name: str) -> torch.Tensor:
        tensor = self.read(name)
        check_finite({name: tensor}, self.directory)
        return tensor


def plan_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list:
    """The specs split into shards of at most `max_bytes` each (a larger tensor alone), in order."""
    shards, size = [[]], 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: Sequence[TensorSpec], metadata: dict) -> bytes:
    entries, offset = {"__metadata__": metadata}, 0
    for spec in specs:
        end = offset + spec.nbytes
        entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _tensor_bytes(tensor: torch.Tensor, spec: TensorSpec) -> memoryview:
    if DTYPE_NAMES.get(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"{spec.name}: loaded as {DTYPE_NAMES.get(tensor.dtype, tensor.dtype)} "
            f"{tuple(tensor.shape)}, its spec says {spec.dtype} {spec.shape}"
        )
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(
    path: str, specs: Sequence[TensorSpec], load: Callable[[str], torch.Tensor], metadata: dict
) -> None:
    """One safetensors file of the specs' tensors, loaded one at a time with `load(name)`."""
    laid_out = sorted(specs, key=lambda s: -DTYPES[s.dtype].itemsize)
    with open(path, "xb") as f:
        f.write(_header(laid_out, metadata))
        for spec in laid_out:
            f.write(_tensor_bytes(load(spec.name), spec))


def write_sharded(
    directory: str, specs: Sequence[TensorSpec], load: Callable[[str], torch.Tensor], max_shard_size
) -> list:
    """Write the specs' tensors to `directory` (module docstring); returns the files written."""
    shards = plan_shards(specs, parse_size(max_shard_size))
    metadata = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors(os.path.join(directory, f"{WEIGHTS_STEM}.safetensors"), specs, load, metadata)
        return [f"{WEIGHTS_STEM}.safetensors"]
    files = [shard_file(WEIGHTS_STEM, i, len(shards)) for i in range(len(shards))]
    for file, shard in zip(files, shards):
        write_safetensors(os.path.join(directory, file), shard, load, metadata)
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.name: file for file, shard in zip(files, shards) for s in shard},
    }
    with open(os.path.join(directory, index_file(WEIGHTS_STEM)), "x", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return files + [index_file(WEIGHTS_STEM)]
