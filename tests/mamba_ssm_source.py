"""mamba_ssm's Triton kernels and PyTorch references, to run beside ours under Triton's interpreter.

Its source release's Python files (scripts/setup.sh fetches them into .venv/mamba_ssm-src;
MAMBA_SSM_SRC names another folder holding mamba_ssm/) load through megamamba.testing's loader,
which stubs the CUDA extension, keeps one configuration per autotuned kernel and, on the CPU,
stands in for the CUDA device context and SM count its kernels ask for. `loaded()` leaves
mamba_ssm importable only inside it: transformers runs mamba_ssm's CUDA kernels whenever it can
import it, so it must not stay importable for the tests after.
"""

import contextlib
import os
import sys

from megamamba.testing.mamba_ssm_release import cpu_stand_ins
from megamamba.testing.mamba_ssm_release import load as load_release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SRC = os.path.join(ROOT, ".venv", "mamba_ssm-src")


def source_folder() -> str:
    return os.environ.get("MAMBA_SSM_SRC") or DEFAULT_SRC


def present() -> bool:
    """Whether the source release is there (without importing it)."""
    return os.path.isdir(os.path.join(source_folder(), "mamba_ssm"))


def load():
    """(namespace of mamba_ssm's entry points, None) or (None, why it is not available)."""
    theirs, why = load_release(source_folder())
    return (
        (theirs, None)
        if theirs is not None
        else (None, f"mamba_ssm's source release: {why}; scripts/setup.sh fetches it")
    )


@contextlib.contextmanager
def loaded():
    """(namespace, None) or (None, why) as `load`, with the CPU stand-ins in place; on leaving, the
    import path and every module mamba_ssm brought (and the stubbed CUDA extension) are gone."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        with cpu_stand_ins():
            yield load()
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.split(".")[0] in ("mamba_ssm", "selective_scan_cuda"):
                del sys.modules[name]
