"""The shipped Triton cache is keyed as the GPU machine's Triton keys it: the same release built for
another Python hashes the same sources and its own libtriton (benchmarks/gpu_check/triton_cache.py)."""

import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest
import triton
import triton.runtime.cache

ROOT = Path(__file__).resolve().parents[3]
HASHED = ("compiler", "backends", "language")


def load_triton_cache():
    spec = importlib.util.spec_from_file_location("triton_cache", ROOT / "benchmarks" / "gpu_check" / "triton_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(path, libtriton: bytes, version=triton.__version__, edit=None):
    """A wheel of this Triton's hashed sources with another libtriton; `edit` (a relative path) altered."""
    root = Path(triton.__file__).parent
    with zipfile.ZipFile(path, "w") as whl:
        sources = [p for folder in HASHED for p in (root / folder).rglob("*.py")] + [root / "runtime" / "cache.py"]
        for source in sources:
            rel = source.relative_to(root).as_posix()
            data = source.read_bytes() + (b"# another build\n" if rel == edit else b"")
            whl.writestr(f"triton/{rel}", data)
        whl.writestr("triton/_C/libtriton.so", libtriton)
        whl.writestr(f"triton-{version}.dist-info/METADATA", f"Name: triton\nVersion: {version}\n")
    return str(path)


def test_keys_inside_hash_the_wheels_libtriton_in_place_of_ours(tmp_path):
    keys_of_wheel = load_triton_cache().keys_of_wheel
    before = triton.runtime.cache.triton_key()
    with keys_of_wheel(fake_wheel(tmp_path / "t.whl", b"libtriton built for another Python")):
        inside = triton.runtime.cache.triton_key()
    changed = [(a, b) for a, b in zip(before.split("-"), inside.split("-"), strict=True) if a != b]
    assert [b for _, b in changed] == [hashlib.sha256(b"libtriton built for another Python").hexdigest()]
    assert triton.runtime.cache.triton_key() == before


@pytest.mark.parametrize("case", ["another release", "other sources"])
def test_a_wheel_that_differs_beyond_libtriton_is_refused(tmp_path, case):
    keys_of_wheel = load_triton_cache().keys_of_wheel
    if case == "another release":
        wheel, says = fake_wheel(tmp_path / "t.whl", b"x", version="0.0.1"), "Triton 0.0.1"
    else:
        wheel, says = fake_wheel(tmp_path / "t.whl", b"x", edit="compiler/compiler.py"), "compiler/compiler.py differs"
    with pytest.raises(SystemExit, match=says):
        with keys_of_wheel(wheel):
            pass
    assert os.path.exists(wheel)
