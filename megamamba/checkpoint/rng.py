"""Random-number-generator states of every rank: Python's, NumPy's global, torch's CPU and CUDA ones.

Each rank writes its own file; which state a rank restores at another world size, and why that
does not change the loss curve: docs/checkpoints.md.
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
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    """Set this process's generators to `state` (see the module docstring for CUDA)."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
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
        scalars.append(
            {
                "python": s["python"],
                "numpy": {k: v for k, v in s["numpy"].items() if k != "keys"},
                "cuda_devices": len(s["cuda"]),
            }
        )
    return tensors, {"rng": json.dumps(scalars)}


def from_file(tensors: dict, metadata: dict) -> list:
    """The states `to_file` wrote, in order."""
    states = []
    for rank, s in enumerate(json.loads(metadata["rng"])):
        states.append(
            {
                "python": s["python"],
                "numpy": {**s["numpy"], "keys": tensors[f"{rank}.numpy"]},
                "torch": tensors[f"{rank}.torch"],
                "cuda": [tensors[f"{rank}.cuda.{i}"] for i in range(s["cuda_devices"])],
            }
        )
    return states
