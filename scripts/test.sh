#!/usr/bin/env bash
# Run the test suite in the project's venv on two pytest-xdist workers (`--dist loadfile`: a file stays on one
# worker, so its module fixtures run once), handed the files in the order tests/conftest.py gives them
# (`--no-loadscope-reorder`: pytest-xdist would otherwise put the files with the most tests first). Arguments
# go to pytest, e.g. `-m "not slow"` (the fast tier); `-n 0` runs one process.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
