#!/usr/bin/env bash
# Set up a fresh machine for megamamba: a virtual environment in .venv with torch,
# DeepSpeed, Triton and megamamba installed (editable) with its test extras and lm-eval
# (the eval extra, for `python -m megamamba.evaluate` and its tests).
#
# Every package is installed at the version constraints.txt pins, the versions the suite last
# passed with, so a new upstream release does not change what CI installs. `--latest` installs
# the newest releases setup.py's bounds allow instead (torch stays the build already installed),
# to try them on purpose; scripts/freeze.sh records them once the suite passes (docs/testing.md).
#
# On a CPU-only machine torch 2.13.0 (CPU build) is installed; a machine that already has a
# CUDA torch should create the venv with --system-site-packages (MEGAMAMBA_SYSTEM_SITE=1)
# so that torch and its Triton are kept (their pins do not apply). DeepSpeed's source build
# imports torch, hence --no-build-isolation.
set -euo pipefail
cd "$(dirname "$0")/.."
latest=0
for arg in "$@"; do
  case "$arg" in
    --latest) latest=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (the only option is --latest)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
step() { echo "setup.sh: $*"; }  # each step says what it installs: the whole set-up takes minutes
if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv"
  if [ "${MEGAMAMBA_SYSTEM_SITE:-0}" = 1 ]; then
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
. .venv/bin/activate
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
if [ "$latest" = 1 ]; then
  upgrade=(--upgrade --upgrade-strategy eager)
elif [ "${MEGAMAMBA_SYSTEM_SITE:-0}" = 1 ]; then
  upgrade=(--upgrade)
  grep -Ev '^(torch|triton)==' constraints.txt > "$pins"
else
  upgrade=(--upgrade)
  cp constraints.txt "$pins"
fi
step "installing pip, setuptools and wheel"
python -m pip install -q "${upgrade[@]}" -c "$pins" pip setuptools wheel
if ! python -c "import torch" 2>/dev/null; then
  step "installing torch 2.13.0 (the CPU build)"
  python -m pip install -q -c "$pins" "torch==2.13.0"
fi
if [ "$latest" = 1 ]; then  # the torch build installed stays; everything else moves to its newest release
  python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$pins"
fi
step "installing ninja and DeepSpeed 0.19 (built from its source release)"
python -m pip install -q "${upgrade[@]}" -c "$pins" ninja
python -m pip install -q "${upgrade[@]}" -c "$pins" --no-build-isolation "deepspeed>=0.19,<0.20"
step "installing megamamba (editable), its test tools (pytest, transformers, ruff, mypy) and lm-eval (the eval extra)"
python -m pip install -q "${upgrade[@]}" -c "$pins" --no-build-isolation -e ".[dev,eval]"
# mamba_ssm 2.3.2.post1's Python files from its source release (its CUDA extension is never built): the kernel
# tests and benchmarks run its Triton kernels and PyTorch references beside ours on the same inputs.
if [ ! -d .venv/mamba_ssm-src/mamba_ssm ]; then
  step "fetching mamba_ssm 2.3.2.post1's Python sources (reference for the kernel tests)"
  tmp=$(mktemp -d)
  MAMBA_SKIP_CUDA_BUILD=TRUE python -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    "mamba_ssm==2.3.2.post1" -d "$tmp"
  tar xzf "$tmp/mamba_ssm-2.3.2.post1.tar.gz" -C "$tmp"
  mkdir -p .venv/mamba_ssm-src
  cp -r "$tmp/mamba_ssm-2.3.2.post1/mamba_ssm" .venv/mamba_ssm-src/
  rm -rf "$tmp"
fi
python -c "import torch, triton, deepspeed, transformers, lm_eval, megamamba; print('megamamba ready: torch', torch.__version__, '| triton', triton.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| lm-eval', lm_eval.__version__)" 2>&1 | grep -v 'Setting accelerator'
