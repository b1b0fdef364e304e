"""Which implementation a kernel op runs, Triton or the PyTorch reference, chosen at each call.

MEGAMAMBA_KERNELS chooses: "triton" forces Triton (on CPU tensors it needs TRITON_INTERPRET=1),
"reference" forces PyTorch, unset / "" / "auto" uses Triton for CUDA tensors and the reference
otherwise. Each call costs one lookup of the variable (so tests and users can switch it at run
time); its parsing is cached per value. The Triton modules are imported when first chosen.
"""

import importlib
import os

BACKENDS = ("auto", "reference", "triton")
ENV = "MEGAMAMBA_KERNELS"


_CHOICES: dict = {}  # raw value of ENV -> parsed choice


def _choice(raw) -> str:
    choice = (raw or "").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV}={raw!r} is not one of {', '.join(BACKENDS)}")
    _CHOICES[raw] = choice
    return choice


def backend(device_tensor) -> str:
    """ "triton" or "reference" for an op whose main input is `device_tensor`, as the env asks."""
    raw = os.environ.get(ENV)
    choice = _CHOICES.get(raw) or _choice(raw)
    if choice == "auto":
        return "triton" if device_tensor.is_cuda else "reference"
    return choice


def triton(module: str):
    """megamamba.kernels.triton.<module>: one op's Triton forward and backward."""
    return importlib.import_module(f"megamamba.kernels.triton.{module}")
