"""Our files never stand in for someone else's module. Python looks first in the folder a process
starts from (`python -m`, `python -c` in the checkout's root; a script's own folder; a test file's
folder under pytest), so no module or package of ours there may carry the top-level name of an
installed distribution or of the standard library. transformers 5 imports PyPI's `kernels`, which
our top-level `kernels/` shadowed until it lost its `__init__.py` (docs/architecture.md)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALWAYS_TAKEN = {"kernels": ["kernels (PyPI; transformers imports it)"]}


def search_folders() -> list:
    """The root, each script folder, and every folder holding test files (pytest's default import
    mode puts a test file's folder first on sys.path)."""
    tests = sorted({path.parent for path in (ROOT / "tests").rglob("*.py")})
    return [ROOT, ROOT / "benchmarks", ROOT / "benchmarks" / "gpu_check", ROOT / "scripts", ROOT / "launch", *tests]


def top_level_names(folder: Path) -> dict:
    """{import name: path} of the modules and regular packages in `folder`. A folder without an
    __init__.py is left out: a regular package found later on sys.path wins over it."""
    modules = {path.stem: path for path in folder.glob("*.py")}
    packages = {path.name: path for path in folder.iterdir() if (path / "__init__.py").is_file()}
    return {**modules, **packages}


def taken_names() -> dict:
    """{top-level import name: who provides it} for every installed distribution but ours and the stdlib."""
    taken = {
        name: dists
        for name, dists in importlib.metadata.packages_distributions().items()
        if set(dists) != {"megamamba"}
    }
    taken.update({name: ["the standard library"] for name in sys.stdlib_module_names})
    return {**taken, **ALWAYS_TAKEN}


def test_no_module_of_ours_where_imports_start_has_the_name_of_an_installed_one():
    taken = taken_names()
    clashes = [
        f"{path.relative_to(ROOT)} imports as `{name}`, which {', '.join(taken[name])} provides; "
        f"from {folder.relative_to(ROOT) if folder != ROOT else 'the root'} ours is found first"
        for folder in search_folders()
        for name, path in top_level_names(folder).items()
        if name in taken
    ]
    assert not clashes, "\n".join(clashes)


def test_import_kernels_in_the_root_gives_the_installed_distribution():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyPI's kernels is not installed (transformers 5 brings it)")
    proc = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    assert found == Path(dist.locate_file("kernels/__init__.py")).resolve(), f"import kernels gave {found}"


def test_the_build_backend_prepares_our_metadata_in_the_root(tmp_path):
    """`pip install -e .` and `pip install DIR` run setup.py with its folder first on sys.path, and
    setuptools then loads every installed distribution's egg_info writers (PyPI's kernels has one,
    kernels._internals.locking)."""
    prepare = (
        "import sys\nfrom setuptools.build_meta import __legacy__ as backend\n"
        "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prepare, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_info = tmp_path / proc.stdout.strip().splitlines()[-1]
    assert (dist_info / "top_level.txt").read_text().split() == ["megamamba"]
