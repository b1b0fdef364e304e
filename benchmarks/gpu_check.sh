#!/usr/bin/env bash
# Every GPU check of the kernels and the training engine, in one device call of at most 10 minutes
# on one H200, with .whl/ from benchmarks/gpu_prepare.sh carried:
#
#   bash benchmarks/gpu_check.sh [all|kernels|train]    (one part alone when a call ran out of time)
#
#   kernels  benchmarks/kernels.py: each Triton op and gradient against the reference in fp32 (TF32
#            off) and bf16, past 64K tokens; forward and forward+backward timings at the Mamba-2
#            130M/370M/1.3B and Mamba-1 layer shapes, against mamba_ssm's Triton SSD (240 s at most)
#   train    benchmarks/train.py: tokens/s, TFLOP/s, MFU, peak memory of Mamba-2 130M/370M/1.3B, ours
#            next to mamba_ssm + torch AMP, then `deepspeed launch/train.py` steps of 2.7B (300 s)
# Logs, JSON and the markdown table go to $OUT (default runs/gpu_check); the tables are printed last.
set -uo pipefail
part=${1:-all}
case "$part" in all|kernels|train) ;; *) echo "usage: gpu_check.sh [all|kernels|train], got '$part'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH   # the `deepspeed` launcher is in /tmp/site/bin
src=.whl/mamba_ssm-src
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton, deepspeed; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| triton', triton.__version__, '| deepspeed', deepspeed.__version__)"
} > "$OUT/versions.txt" 2>&1
kernels=skipped train=skipped
if [ "$part" != train ]; then
  timeout 240 python3 benchmarks/kernels.py --mamba-ssm-src "$src" --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  kernels=$?
fi
if [ "$part" != kernels ]; then
  timeout 300 python3 benchmarks/train.py --mamba-ssm-src "$src" --results "$OUT/train.md" > "$OUT/train.log" 2>&1
  train=$?
fi
cat "$OUT/versions.txt"
echo "== benchmarks/kernels.py (exit $kernels)"; [ -f "$OUT/kernels.log" ] && tail -n 40 "$OUT/kernels.log"
echo "== benchmarks/train.py (exit $train)"; [ -f "$OUT/train.log" ] && tail -n 25 "$OUT/train.log"
for status in "$kernels" "$train"; do
  [ "$status" = 0 ] || [ "$status" = skipped ] || exit 1
done
