#!/usr/bin/env bash
# Record the venv's packages in constraints.txt, the versions scripts/setup.sh installs. Run it after
# `bash scripts/setup.sh --latest` and a passing `bash scripts/test.sh` (docs/testing.md, "Versions").
# Local version labels are dropped (torch 2.13.0+cpu is pinned as torch==2.13.0, which a CPU or a
# CUDA build satisfies); megamamba itself, installed editable, is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
{
  echo "# The versions the test suite last passed with: scripts/setup.sh installs with them (pip -c)."
  echo "# Written by scripts/freeze.sh on $(date -u +%Y-%m-%d) with Python $("$python" -c 'import platform; print(platform.python_version())')."
  "$python" -m pip freeze --all --local --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$//'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "freeze.sh: $(grep -vc '^#' constraints.txt) packages pinned in constraints.txt"
