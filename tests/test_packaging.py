"""The package as pip installs it: `pip install --no-deps --target DIR` of the sources, then every
subpackage imported by a fresh interpreter whose working directory is outside the checkout and
whose import path holds DIR but not the checkout. megamamba.kernels and megamamba.pipelines exist
only through setup.py's package_dir, so a checkout on PYTHONPATH cannot stand in for this."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("megamamba", "kernels", "pipelines")
TREES = {
    "megamamba": "megamamba",
    "kernels/api": "megamamba.kernels",
    "kernels/triton": "megamamba.kernels.triton",
    "kernels/reference": "megamamba.kernels.reference",
    "pipelines": "megamamba.pipelines",
}
PROBE = """
import importlib, json, os, sys
names = json.loads(sys.argv[1])
files = {n: importlib.import_module(n).__file__ for n in names}
print(json.dumps({"path": [os.path.abspath(p) for p in sys.path], "files": files}))
"""


def expected_packages() -> list:
    """Every import name setup.py maps, from the source folders."""
    names = []
    for folder, name in TREES.items():
        names += [name] + [f"{name}.{p}" for p in find_packages(str(ROOT / folder))]
    return sorted(names)


def test_every_subpackage_imports_from_the_installed_copy(tmp_path):
    src, site, cwd = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir(), cwd.mkdir()
    # A copy of the sources: pip builds in the source tree, and a stale build/ there could leak files.
    shutil.copy(ROOT / "setup.py", src)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = expected_packages()
    for required in (
        "megamamba.kernels.triton",
        "megamamba.kernels.reference",
        "megamamba.parallel",
        "megamamba.checkpoint",
        "megamamba.data",
        "megamamba.tokenizer",
        "megamamba.pipelines",
    ):
        assert required in names
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(names)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(ROOT) not in answer["path"]
    wrong = {n: f for n, f in answer["files"].items() if not Path(f).is_relative_to(site)}
    assert not wrong, f"imported from outside {site}: {wrong}"
