#!/usr/bin/env bash
# Prepare what the GPU check carries to the GPU machine (an H200 with torch 2.11, Triton 3.6, no
# DeepSpeed, no network), on this machine, into .whl/ (ignored by git, never committed):
#   - DeepSpeed 0.19.8 and the packages it lacks there, as wheels (shared/device/prepare.sh);
#   - what launch/train.py and mamba_ssm import beyond torch and DeepSpeed: safetensors, tokenizers,
#     sentencepiece, einops (wheels for its Python 3.12; whatever it has is shadowed by them);
#   - setuptools (this venv's version): gpu_check.sh builds the package there offline with it;
#   - the Python files of mamba_ssm 2.3.2.post1's source release (.whl/mamba_ssm-src/, copied from the one
#     scripts/setup.sh fetched), which the benchmarks compare against (its CUDA extension is never built:
#     the benchmarks stub it);
#   - every kernel the ops launch compiled for sm_90 with Triton 3.6 (installed beside the venv's own, in
#     .venv/triton-3.6), each within the block limits and without spills (compile_kernels.py; its report
#     goes to .whl/compile_kernels-3.6.0.json, and a failure stops the preparation);
#   - Triton's cache, pre-filled for sm_90 with Triton 3.6 for every kernel the
#     check launches (benchmarks/gpu_check/triton_cache.py; rebuilt each time: it follows the kernel sources),
#     keyed as the GPU machine's Triton keys it: its key hashes libtriton, which differs between the
#     Python 3.11 build here and the 3.12 build there, so the 3.12 wheel is fetched to read its hash.
# Then one device call carrying .whl runs every check: `bash benchmarks/gpu_check/gpu_check.sh`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. .venv/bin/activate
bash ../shared/device/prepare.sh
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "safetensors==0.8.0" "tokenizers==0.23.3" "sentencepiece==0.2.3" "einops==0.8.2" \
  "setuptools==$(python -c 'import setuptools; print(setuptools.__version__)')"
if [ ! -d .whl/mamba_ssm-src/mamba_ssm ]; then
  mkdir -p .whl/mamba_ssm-src
  cp -r .venv/mamba_ssm-src/mamba_ssm .whl/mamba_ssm-src/
fi
if [ ! -d .venv/triton-3.6/triton ]; then
  python -m pip install -q --no-deps --target .venv/triton-3.6 "triton==3.6.0"
fi
env -u TRITON_INTERPRET PYTHONPATH=.venv/triton-3.6 python benchmarks/gpu_check/compile_kernels.py --arch 90 \
  --json .whl/compile_kernels-3.6.0.json
rm -f .whl/triton-cache-*.tar.gz
wheel=$(mktemp -d)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$wheel" "triton==3.6.0"
env -u TRITON_INTERPRET PYTHONPATH=.venv/triton-3.6 python benchmarks/gpu_check/triton_cache.py \
  --out .whl/triton-cache-3.6.0.tar.gz --triton-wheel "$wheel"/triton-3.6.0-*.whl
rm -rf "$wheel"
du -sh .whl
