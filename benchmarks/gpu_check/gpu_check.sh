#!/usr/bin/env bash
# The GPU check, in one device call on an H200 with torch 2.11: at most 9.5 minutes with install and
# compilation (a budget of 560 s, sections cut to fit), with .whl/ from benchmarks/gpu_check/gpu_prepare.sh carried:
#
#   bash benchmarks/gpu_check/gpu_check.sh [--dry-run] [--only SECTION ...]      (DRY_RUN=1 also: the CPU)
#
# 1. installs the wheels of .whl/ and then the package itself (from a fresh copy of its sources)
#    into $WORK/site (WORK: a new temporary folder unless set) with pip --no-deps --no-index: the check imports megamamba from there, never
#    from the checkout (megamamba.kernels and .pipelines exist only once installed);
# 2. hands the driver Triton's cache shipped in .whl/ (benchmarks/gpu_check/triton_cache.py), which it unpacks
#    under $WORK and points TRITON_CACHE_DIR at;
# 3. runs benchmarks/gpu_check/gpu_check.py from outside the checkout: import smoke, NCCL smoke with save and
#    resume, op errors against float64, op timings, training throughput, 20-step loss parity with
#    mamba_ssm; each section in its own process with a timeout.
# Everything lands in $OUT (default runs/gpu_check): results.jsonl (one record per measurement,
# written as measured), one log per section, install.log; the summary is printed last. Bulky
# files (the install, the unpacked cache, the smoke's checkpoints) stay in $WORK. The dry run
# (CPU, reference kernels, tiny configs, gloo, no mamba_ssm) installs only the package, with the
# running environment's setuptools. PYTHON picks the interpreter (default python3).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
dry=${DRY_RUN:-0}
args=()
for a in "$@"; do
  if [ "$a" = --dry-run ]; then dry=1; else args+=("$a"); fi
done
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$repo/runs/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d)}  # bulky files (install, Triton cache, checkpoints): never in $OUT
site=$WORK/site src=$WORK/src
rm -rf "$site" "$src" && mkdir -p "$site" "$src"
start=$SECONDS
pip_install=("$PYTHON" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$site")
{
  if [ "$dry" != 1 ]; then
    "${pip_install[@]}" "$repo"/.whl/*.whl || echo "gpu_check.sh: installing .whl/*.whl failed"
  fi
  # A fresh copy: a stale build/ in the checkout cannot leak files into the install.
  cp -r "$repo/setup.py" "$repo/megamamba" "$repo/kernels" "$repo/pipelines" "$src"/
  PYTHONPATH=$site "${pip_install[@]}" --no-build-isolation "$src"
} > "$OUT/install.log" 2>&1
echo "gpu_check.sh: install exit $? in $((SECONDS - start)) s (log: $OUT/install.log)"
export PYTHONPATH=$site PATH=$site/bin:$(dirname "$(command -v "$PYTHON")"):$PATH
cache=$repo/.whl/triton-cache-$("$PYTHON" -c 'import triton; print(triton.__version__)' 2>/dev/null).tar.gz
triton_cache=()
if [ "$dry" != 1 ] && [ -f "$cache" ]; then
  triton_cache=(--triton-cache "$cache")
elif [ "$dry" != 1 ]; then
  echo "gpu_check.sh: no $cache (benchmarks/gpu_check/gpu_prepare.sh makes it): every kernel compiles cold"
fi
flags=(--out "$OUT" --work "$WORK" --site "$site" --mamba-ssm-src "$repo/.whl/mamba_ssm-src" ${triton_cache[@]+"${triton_cache[@]}"}
       --budget "${BUDGET:-$((560 - (SECONDS - start)))}")
[ "$dry" = 1 ] && flags+=(--dry-run --budget "${BUDGET:-2400}")
cd "$OUT" && exec "$PYTHON" "$repo/benchmarks/gpu_check/gpu_check.py" "${flags[@]}" ${args[@]+"${args[@]}"}
