"""A script of benchmarks/ or benchmarks/gpu_check/ as a module, loaded by its path: the tests keep
those folders off sys.path."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py (`name` may hold a folder: "gpu_check/check_io"), executed afresh as the
    module `benchmark_<name>`."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name.replace('/', '_')}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
