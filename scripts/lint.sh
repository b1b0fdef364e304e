#!/usr/bin/env bash
# Lint the repository with ruff (rules in pyproject.toml); exits non-zero when there are findings.
# `bash scripts/lint.sh --fix` applies ruff's safe fixes (import order among them).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/ruff check "$@" .
