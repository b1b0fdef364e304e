#!/usr/bin/env bash
# Lint the repository: ruff check and ruff format --check (settings in pyproject.toml), then mypy on
# the product code against its baseline (scripts/typecheck.py); exits non-zero on any finding.
# `bash scripts/lint.sh --fix` applies ruff's safe fixes (import order among them).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check "$@" .
.venv/bin/ruff format --check .
.venv/bin/python scripts/typecheck.py
