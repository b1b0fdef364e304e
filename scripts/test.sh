#!/usr/bin/env bash
# Run the test suite in the project's venv. Arguments go to pytest, e.g. `-m "not slow"` (the fast tier).
# `-n 2 --dist loadfile` runs it on two pytest-xdist workers (docs/testing.md says what that gives today).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest "$@"
