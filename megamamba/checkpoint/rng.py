"""Random-number-generator states of every rank: Python's, NumPy's global, torch's CPU and CUDA ones.

A state is a dict {"python": [...], "numpy": {...}, "torch": uint8 tensor, "cuda": [uint8 tensors]}
(`capture_rng`). In a checkpoint each rank writes its own safetensors file (format version 1: one
file of all ranks): the tensors under "<i>.torch", "<i>.cuda.<j>", "<i>.numpy" (i: the state's
place in the file), the Python and NumPy scalars as JSON in its header metadata.

Which state a rank restores (`Checkpoint.rng_state`): with as many ranks as were saved, rank r gets
rank r's; otherwise every rank gets rank 0's. Training draws no random numbers after initialisation
(no dropout; the data comes from the seed and the consumed-sample count the checkpoint records),
so this choice does not change the loss curve; it matters to user code that draws random numbers.
CUDA states are restored when the run has as many CUDA devices as were saved, and skipped otherwise
(e.g. a CPU resume).
"""
import json
import random

import numpy as np
import torch


def capture_rng() -> dict:
    """This process's generator states."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(words), gauss],
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    """Set this process's generators to `state` (see the module docstring for CUDA)."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
        torch.cuda.set_rng_state_all(state["cuda"])


def to_file(states: list) -> tuple:
    """(tensors, metadata) of a safetensors file holding `states` in order."""
    tensors, scalars = {}, []
    for rank, s in enumerate(states):
        tensors[f"{rank}.torch"] = s["torch"]
        tensors[f"{rank}.numpy"] = s["numpy"]["keys"]
        tensors.update({f"{rank}.cuda.{i}": t for i, t in enumerate(s["cuda"])})
        scalars.append({"python": s["python"], "numpy": {k: v for k, v in s["numpy"].items() if k != "keys"},
                        "cuda_devices": len(s["cuda"])})
    return tensors, {"rng": json.dumps(scalars)}


def from_file(tensors: dict, metadata: dict) -> list:
    """The states `to_file` wrote, in order."""
    states = []
    for rank, s in enumerate(json.loads(metadata["rng"])):
        states.append({
            "python": s["python"],
            "numpy": {**s["numpy"], "keys": tensors[f"{rank}.numpy"]},
            "torch": tensors[f"{rank}.torch"],
            "cuda": [tensors[f"{rank}.cuda.{i}"] for i in range(s["cuda_devices"])],
        })
    return states
