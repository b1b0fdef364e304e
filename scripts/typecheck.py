"""Type-check the product code with mypy (settings in pyproject.toml) against a baseline that only shrinks.

mypy reads the packages under the names they are installed as: megamamba.kernels and megamamba.pipelines
exist only through setup.py's package_dir, so the modules are linked into .mypy_cache/packages/ as
installed; launch/'s scripts are checked beside them. A finding is its file, message and error code, not
its line, which moves with every edit. The check fails on a finding the baseline lacks, and on a baseline
finding that is gone: `--update` then removes it, so the baseline only shrinks. `--record` writes every
current finding, for a new mypy release only.

    .venv/bin/python scripts/typecheck.py [--update | --record]
"""

import argparse
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]
TREE = Path(".mypy_cache", "packages")
BASELINE = Path("scripts", "typecheck_baseline.txt")
HEADER = """\
# mypy's findings on the product code that scripts/typecheck.py accepts: one line per finding, as
# "file: message [code]". Fix them and remove their lines (typecheck.py --update); never add one.
"""
MYPY_FLAGS = ["--no-error-summary", "--no-pretty", "--hide-error-context", "--no-color-output"]
ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[a-z-]+)\])?$")


def package_dirs() -> dict:
    """setup.py's mapping of import names to folders, read without running setup()."""
    real_setup = setuptools.setup
    setuptools.setup = lambda **_: None
    try:
        return runpy.run_path("setup.py")["PACKAGE_DIRS"]
    finally:
        setuptools.setup = real_setup


def link_packages() -> None:
    """Lay the modules out under TREE as pip installs them, one link per file."""
    shutil.rmtree(TREE, ignore_errors=True)
    for name, folder in package_dirs().items():
        target = TREE.joinpath(*name.split("."))
        target.mkdir(parents=True)
        for source in Path(folder).glob("*.py"):
            (target / source.name).symlink_to(ROOT / source)


def run_mypy() -> tuple[list, list]:
    """mypy's error lines with their files as in the checkout, and each one's finding."""
    command = [sys.executable, "-m", "mypy", *MYPY_FLAGS, str(TREE / "megamamba"), "launch"]
    proc = subprocess.run(command, env=dict(os.environ, MYPYPATH=str(TREE)), capture_output=True, text=True)
    lines, found = [], []
    for line in proc.stdout.splitlines():
        m = ERROR.match(line)
        if m:
            path = os.path.relpath(os.path.realpath(m["path"]), ROOT)
            lines.append(f"{path}:{m['line']}: error: {m['message']}  [{m['code']}]")
            message = re.sub(r"on line \d+", "on line N", m["message"])  # another line's number moves too
            found.append(f"{path}: {message} [{m['code']}]")
    if proc.returncode not in (0, 1) or (proc.returncode == 1) != bool(found):
        sys.exit(f"typecheck: mypy exited {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return lines, found


def write_baseline(findings: Counter) -> None:
    BASELINE.write_text(HEADER + "".join(f"{f}\n" for f in sorted(findings.elements())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", action="store_true", help="remove the baseline's fixed findings")
    mode.add_argument("--record", action="store_true", help="record every current finding (a new mypy release)")
    args = parser.parse_args()
    os.chdir(ROOT)
    start = time.monotonic()
    link_packages()
    lines, found = run_mypy()
    now = Counter(found)
    if args.record:
        write_baseline(now)
    known = Counter(line for line in BASELINE.read_text().splitlines() if line and not line.startswith("#"))
    new, fixed = now - known, known - now
    if args.update and fixed:
        known = known & now
        write_baseline(known)
        print(f"typecheck: {fixed.total()} fixed finding(s) removed from {BASELINE}")
        fixed = Counter()
    for line, finding in zip(lines, found):
        if finding in new:
            print(line)
    if new:
        print(
            f"typecheck: {new.total()} new finding(s) above (a message repeated more often than {BASELINE} "
            "holds it counts as new): fix them"
        )
    if fixed:
        print("".join(f"{f}\n" for f in sorted(fixed.elements())), end="")
        print(
            f"typecheck: the {fixed.total()} finding(s) above are fixed: remove them from {BASELINE} "
            "(.venv/bin/python scripts/typecheck.py --update)"
        )
    print(
        f"typecheck: mypy {version('mypy')}, {now.total()} findings, {known.total()} in the baseline, "
        f"{time.monotonic() - start:.1f} s"
    )
    return 1 if new or fixed else 0


if __name__ == "__main__":
    sys.exit(main())
