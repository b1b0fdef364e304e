"""What every section of the GPU check shares: its JSONL records, the count of Triton compilations
that the shipped cache answered, and the benchmarks it runs (benchmarks/*.py, loaded by path; child
processes with a hard timeout come from megamamba.testing.processes, mamba_ssm from
megamamba.testing.mamba_ssm_release).

The check may be cut short at any moment, so nothing is kept for the end: each record is one
line appended and flushed to $OUT/results.jsonl as soon as it is measured.
"""

import importlib.util
import json
import os
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "results.jsonl"
COMPILES = "triton_compiles.jsonl"


def load_benchmark(name: str):
    """benchmarks/<name>.py, a benchmark the check runs, as the module benchmark_<name> (loaded once)."""
    key = f"benchmark_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(BENCHMARKS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


class Results:
    """Appends one JSON object per measurement to <out>/results.jsonl, flushed at once."""

    def __init__(self, out: str, section: str):
        self.path, self.section, self.t0 = os.path.join(out, RESULTS), section, time.time()

    def write(self, kind: str, **fields) -> dict:
        record = {"section": self.section, "kind": kind, "t": round(time.time() - self.t0, 2), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(f"[{self.section}] {kind}: " + " ".join(f"{k}={_short(v)}" for k, v in fields.items()), flush=True)
        return record


def _short(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)[:160]


def read_results(out: str) -> list:
    """Every complete record of <out>/results.jsonl (a line cut by a kill is skipped)."""
    path = os.path.join(out, RESULTS)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def count_triton_compiles(out: str, section: str) -> None:
    """Log every Triton compilation of this process to <out>/triton_compiles.jsonl: cache_hit true
    when the on-disk cache (TRITON_CACHE_DIR) held the kernel, false when it was compiled anew."""
    try:
        from triton import knobs
    except ImportError:  # Triton without knobs (older than 3.4): nothing counted
        return
    path = os.path.join(out, COMPILES)

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        name = getattr(getattr(src, "fn", None), "__name__", None) or metadata.get("name", "?")
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {"section": section, "kernel": name, "cache_hit": bool(cache_hit), "hash": metadata.get("hash")}
                )
                + "\n"
            )

    knobs.compilation.listener = listener


def unpack_triton_cache(archive: str, dest: str) -> int:
    """Unpack a Triton cache archive (benchmarks/gpu_check/triton_cache.py) into `dest` and point each kernel's
    group file at its new place: Triton 3.6 records a group's files by absolute path
    (FileCacheManager.put_group) and treats a group whose files it cannot find there as a miss, so a
    cache moved to another folder is never hit until they are rewritten. Returns the entry count."""
    import tarfile

    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    entries = os.listdir(dest)
    for entry in entries:
        folder = os.path.join(dest, entry)
        for name in os.listdir(folder):
            if name.startswith("__grp__"):
                with open(os.path.join(folder, name)) as f:
                    group = json.load(f)
                group["child_paths"] = {
                    child: os.path.join(folder, os.path.basename(path)) for child, path in group["child_paths"].items()
                }
                with open(os.path.join(folder, name), "w") as f:
                    json.dump(group, f)
    return len(entries)


def triton_cache_identity() -> dict:
    """What Triton's cache keys depend on beyond the kernel and its options: sha256 of triton_key()
    (its version, compiler sources and libtriton), the `ptxas --version` of the ptxas it uses for
    sm_90, and the cache-invalidating variables set. Equal on two machines, equal keys."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    return {
        "triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
        "ptxas": " | ".join(get_ptxas_version(90).strip().splitlines()[-2:]),
        "env": get_cache_invalidating_env_vars(),
    }
