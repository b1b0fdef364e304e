"""What every section of the GPU check shares: its JSONL records, child processes with a streamed
log and a hard timeout, mamba_ssm loaded from its source release with its autotuning capped, and
the count of Triton compilations that the shipped cache answered.

The check may be cut short at any moment, so nothing is kept for the end: each record is one
line appended and flushed to $OUT/results.jsonl as soon as it is measured.
"""
import json
import os
import signal
import subprocess
import sys
import time
import types

RESULTS = "results.jsonl"
COMPILES = "triton_compiles.jsonl"
_RUNNING = set()  # process groups run_logged has started and not yet reaped


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


def run_logged(cmd, log: str, timeout: float, env=None, cwd=None, grace: float = 10.0) -> dict:
    """Run `cmd` in its own process group, its stdout and stderr streamed to `log`; past `timeout`
    seconds the whole group gets SIGTERM (train.py saves and stops on it), then SIGKILL after
    `grace`. Returns dict(rc, seconds, timed_out)."""
    start = time.time()
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        _RUNNING.add(proc.pid)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc, grace)
        finally:
            _signal_group(proc.pid, signal.SIGKILL)  # strays of a finished group (e.g. a launcher's ranks)
            _RUNNING.discard(proc.pid)
    return dict(rc=proc.returncode, seconds=round(time.time() - start, 1), timed_out=timed_out)


def _stop_group(proc, grace: float) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_children_on_sigterm(grace: float = 5.0) -> None:
    """On SIGTERM (the driver's timeout), stop the groups run_logged started, which live in their own
    sessions and would outlive this process on the GPU, then exit with 143."""
    def handler(signum, frame):
        for pid in list(_RUNNING):
            _signal_group(pid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and any(_alive(pid) for pid in _RUNNING):
            time.sleep(0.2)
        for pid in list(_RUNNING):
            _signal_group(pid, signal.SIGKILL)
        os._exit(143)
    signal.signal(signal.SIGTERM, handler)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


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
            f.write(json.dumps({"section": section, "kernel": name, "cache_hit": bool(cache_hit),
                                "hash": metadata.get("hash")}) + "\n")
    knobs.compilation.listener = listener


def unpack_triton_cache(archive: str, dest: str) -> int:
    """Unpack a Triton cache archive (benchmarks/triton_cache.py) into `dest` and point each kernel's
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
                group["child_paths"] = {child: os.path.join(folder, os.path.basename(path))
                                        for child, path in group["child_paths"].items()}
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
    return {"triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
            "ptxas": " | ".join(get_ptxas_version(90).strip().splitlines()[-2:]),
            "env": get_cache_invalidating_env_vars()}


# ----------------------------------------------------------------------------- mamba_ssm

def names_only_module(name):
    """A stand-in module every public name can be imported from (mamba_ssm's generation helpers
    import transformers, which the GPU machine lacks; training never uses them)."""
    module = types.ModuleType(name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return object
    module.__getattr__ = __getattr__
    return module


CHOICES = "autotune_choices.json"  # beside mamba_ssm/ in its source folder, written by triton_cache.py


def load_mamba_ssm(src: str):
    """mamba_ssm from its unpacked source release (the folder holding mamba_ssm/) with its compiled
    extension stubbed: a namespace of the entry points the check compares with, or (None, why not).

    Every autotuned Triton kernel of mamba_ssm keeps one configuration, so its first use compiles
    one kernel per shape instead of timing a dozen: the one <src>/autotune_choices.json names (the
    first of its list that fits an sm_90 block at every shape the check runs, found by
    benchmarks/triton_cache.py), else its first.
    """
    if not src or not os.path.isdir(os.path.join(src, "mamba_ssm")):
        return None, f"no mamba_ssm/ under {src!r}"
    if src not in sys.path:
        sys.path.insert(0, src)
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        import transformers.generation  # noqa: F401
    except ImportError:
        stubbed = ("transformers", "transformers.generation", "transformers.utils", "transformers.utils.hub")
        sys.modules.update({name: names_only_module(name) for name in stubbed})
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref
        from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 - reported as the reason, the check goes on without it
        return None, f"import failed: {exc!r:.300}"
    path = os.path.join(src, CHOICES)
    choices = {}
    if os.path.exists(path):
        with open(path) as f:
            choices = json.load(f)
    tuners = autotuners("mamba_ssm.ops.triton")
    cap_autotuning(tuners, choices)
    picked = ", ".join(f"{name} #{index}" for name, index in sorted(choices.items()) if index) or "none"
    return types.SimpleNamespace(mamba_chunk_scan_combined=mamba_chunk_scan_combined, rmsnorm_fn=rmsnorm_fn,
                                 rms_norm_fn=rms_norm_fn, selective_scan_ref=selective_scan_ref,
                                 MambaLMHeadModel=MambaLMHeadModel, MambaConfig=MambaConfig), \
        f"imported; {len(tuners)} autotuned kernels capped to one config each, the first except: {picked}" \
        + ("" if choices else f" (no {path})")


def autotuners(prefix: str) -> dict:
    """kernel name -> triton Autotuner, for the loaded modules under `prefix`."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for attr, value in vars(module).items():
            while isinstance(value, Heuristics):
                value = value.fn
            if isinstance(value, Autotuner):
                found[attr] = value
    return found


def cap_autotuning(tuners: dict, choices: dict) -> None:
    """Leave each autotuner only its configuration number choices[name] (default 0, the last when
    past the end) of its original list; an autotuner with one configuration runs it unbenchmarked."""
    for name, tuner in tuners.items():
        configs = tuner.__dict__.setdefault("configs_before_cap", tuner.configs)
        tuner.configs = [configs[min(choices.get(name, 0), len(configs) - 1)]]
