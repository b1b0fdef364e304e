"""Session-wide test environment.

Without a GPU, Triton kernels run under its interpreter; the variable is read when
`@triton.jit` runs, so it is set here, before any test module imports a kernel, and the
interpreter is made to compute bf16 as a GPU does (megamamba/testing/interpreter_bf16.py). Each
virtual environment gets its own torch-extension cache (DeepSpeed JIT-builds an op on
`init_distributed`), so two environments never rebuild it for each other. Every Python process
a test starts runs in strict-collectives mode (tests/strict_collectives.py) through
tests/strict_site/sitecustomize.py. The shared training runs' fixtures come from tests/train_runs.py
and tests/resume_runs.py.
"""

import os
import sys
import time

import pytest
import torch

from resume_runs import resume_reference, resume_runs  # noqa: F401  (fixtures)
from train_runs import packed_documents, train_reference, train_runs  # noqa: F401  (fixtures)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from megamamba.testing import interpreter_bf16  # imports triton.language, whose jit functions read it then

    interpreter_bf16.install()
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# Processes the tests start find the venv's tools first, as in an activated venv. DeepSpeed builds its op
# with whichever `ninja` PATH finds; the venv's (1.13) and a system one (1.11) log different command
# hashes, so each rebuilt the op (25 s on 2 cores, every rank waiting) after the other had built it.
os.environ["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), os.environ.get("PATH")) if p)
# Workers of pytest-xdist share the cores: each computes on its share of them, and so does every process a
# test starts. Two OpenMP-threaded processes on two busy cores spin against each other: two train_single.py
# runs side by side took 62 s with two threads each, 8 s with one.
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ["MEGAMAMBA_STRICT_COLLECTIVES"] = "1"
# A pytest-xdist worker is itself a process started with this environment, so its sitecustomize turned strict
# mode on; tests run in a plain process, as in one pytest process (the mode's torch-function hook made
# TorchDynamo graph-break inside Tensor.unflatten). Strict mode is for the processes the tests start.
if "strict_collectives" in sys.modules:
    sys.modules["strict_collectives"].uninstall()
_STRICT_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "strict_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_STRICT_SITE, os.environ.get("PYTHONPATH")) if p)

_SHM = "/dev/shm"
_SHM_PREFIX = "deepspeed_allreduce_buffer_"


def _shm_buffers() -> set:
    return {n for n in os.listdir(_SHM) if n.startswith(_SHM_PREFIX)} if os.path.isdir(_SHM) else set()


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed_shm_buffers():
    """Remove DeepSpeed CPU all-reduce buffers that a test's killed ranks left in RAM-backed /dev/shm.

    Ranks that exit normally release theirs (megamamba.parallel.groups.init_distributed); a rank
    killed before that leaves ~66 MB behind, which a whole suite would pile up into gigabytes.
    Only buffers that appeared during the test and are over a minute old go (not a live start-up).
    """
    before = _shm_buffers()
    yield
    for name in _shm_buffers() - before:
        path = os.path.join(_SHM, name)
        try:
            if time.time() - os.path.getmtime(path) > 60:
                os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session", autouse=True)
def _own_compile_cache(tmp_path_factory):
    """torch.compile's caches (Inductor's FX graphs, AOTAutograd's) in this session's (and xdist worker's)
    own folder, not the machine-wide /tmp/torchinductor_$USER that earlier runs of other checkouts and the
    other worker write: no test reads a compiled graph it did not make."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("torchinductor"))


def pytest_collection_modifyitems(config, items):
    """Files with slow tests run first, each file's tests in their order: pytest-xdist hands the files to the
    workers in this order (`--dist loadfile`), so the long launched runs start early and the many short files
    fill the end, instead of one worker finishing a long file alone on an otherwise idle machine."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
