"""What autograd keeps for a backward, counted with saved-tensor hooks (importable as `saved_tensors`)."""

from collections.abc import Callable

import torch


def autograd_saved_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while `forward()` runs, `model`'s parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())
