#!/usr/bin/env bash
# Run the test suite in the project's venv. Arguments go to pytest, e.g. `-m "not slow"` (the fast tier).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest "$@"
