#!/usr/bin/env bash
# Run the test suite in the project's venv, on two pytest-xdist workers (each test file stays on one
# worker, so a module's fixtures run once; tests/run_cache.py shares the session's runs between them).
# Arguments go to pytest, e.g. `-m "not slow"` (the fast tier), or `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
