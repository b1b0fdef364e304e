#!/usr/bin/env bash
# Quick start on the CPU, from raw text to generated text (run `bash scripts/setup.sh` first):
#   1. dump the built-in corpus (the Python documentation every Python carries) as JSONL
#   2. train a SentencePiece tokenizer on it (BPE, 2048 ids)
#   3. preprocess it into token datasets (.bin/.idx) with a train/validation split
#   4. train a 0.7M-parameter Mamba-2 with `deepspeed --num_gpus 2 launch/train.py`: two processes,
#      data-parallel with ZeRO-1, packed documents; loss, validation loss and the other metrics go
#      to the console, TensorBoard and metrics.jsonl; a checkpoint (a model folder) at the end
#   5. generate text from that checkpoint with `python -m megamamba.generate`
#
#   bash scripts/quickstart.sh [OUTPUT_DIR]      (default runs/quickstart; QUICKSTART_STEPS=200)
#
# QUICKSTART_PATTERN="M*M-" trains a hybrid instead (default OUTPUT_DIR runs/quickstart-hybrid):
# launch/models/quickstart-hybrid.json's layers as Megatron's --hybrid-layer-pattern places them
# (M Mamba-2, * attention, - MLP; 4 symbols). Its attention (no rotary, no biases) and squared-ReLU MLP
# are what transformers' NemotronH computes, so its checkpoint exports there (`convert export`).
# QUICKSTART_MOE=1 trains launch/models/quickstart-moe-hybrid.json instead (default OUTPUT_DIR
# runs/quickstart-moe): ME*E, two mixture-of-experts layers of 8 experts each, split over the two processes
# (--expert-model-parallel-size 2).
#
# It writes data/, tensorboard/, checkpoints/ and metrics.jsonl in OUTPUT_DIR and never replaces them:
# an OUTPUT_DIR holding any of them is refused, and so is one another quick start is writing (the
# script holds a lock on OUTPUT_DIR, taken before anything in it is touched, until it ends).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${QUICKSTART_STEPS:-200}
EVAL_INTERVAL=$(( STEPS >= 4 ? STEPS / 4 : 1 ))  # four validations over the run
MODEL=(--model-config launch/models/quickstart-mamba2.json)
OUT=${1:-runs/quickstart}
if [ -n "${QUICKSTART_MOE:-}" ]; then
  MODEL=(--model-config launch/models/quickstart-moe-hybrid.json --expert-model-parallel-size 2)
  OUT=${1:-runs/quickstart-moe}
elif [ -n "${QUICKSTART_PATTERN:-}" ]; then
  MODEL=(--model-config launch/models/quickstart-hybrid.json --hybrid-layer-pattern "$QUICKSTART_PATTERN")
  OUT=${1:-runs/quickstart-hybrid}
fi
PY=.venv/bin/python
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}  # the test suite's cache
# As in an activated venv: DeepSpeed builds its op with the ninja PATH finds first, and a system ninja
# logs another command hash than the venv's, so each would rebuild the op (25 s) after the other.
export PATH="$PWD/.venv/bin:$PATH"

if [ ! -x .venv/bin/deepspeed ]; then
  echo "quickstart: no .venv with DeepSpeed here; run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
say() { printf '\n== %s (%ds)\n' "$1" "$SECONDS"; }

# The lock is a flock on OUT itself, held through file descriptor 9 by this script and the processes it
# starts; the kernel drops it when the last of them ends.
mkdir -p "$OUT"
exec 9<"$OUT"
if ! flock --nonblock 9; then
  echo "quickstart: $OUT is in use by another quick start; wait for it to end or give another OUTPUT_DIR" >&2
  exit 2
fi
EARLIER=""
for name in data tensorboard checkpoints metrics.jsonl; do
  if [ -e "$OUT/$name" ]; then EARLIER+=" $name"; fi
done
if [ -n "$EARLIER" ]; then
  echo "quickstart: $OUT holds an earlier quick start's outputs (${EARLIER# }); give another OUTPUT_DIR," \
    "or remove them to run here again" >&2
  exit 2
fi
mkdir "$OUT/data"

say "1/5 the built-in corpus -> $OUT/data/corpus.jsonl"
$PY -m megamamba.data.corpus_dump --output "$OUT/data/corpus.jsonl"

say "2/5 SentencePiece tokenizer, 2048 ids -> $OUT/data/spm.model"
$PY -m megamamba.tokenizer.train --input "$OUT/data/corpus.jsonl" --vocab-size 2048 --output-prefix "$OUT/data/spm"

say "3/5 token datasets -> $OUT/data/corpus_{train,valid}.{bin,idx}"
$PY -m megamamba.data.preprocess --input "$OUT/data/corpus.jsonl" --tokenizer "$OUT/data/spm.model" \
  --output-prefix "$OUT/data/corpus" --workers 2 --valid-fraction 0.05

say "4/5 deepspeed --num_gpus 2 launch/train.py: $STEPS steps"
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" launch/train.py \
  --deepspeed_config launch/configs/quickstart-cpu.json "${MODEL[@]}" \
  --tokenizer "$OUT/data/spm.model" --data "$OUT/data/corpus_train" --valid-data "$OUT/data/corpus_valid" \
  --seq-length 128 --train-iters "$STEPS" --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 \
  --log-interval 10 --eval-interval "$EVAL_INTERVAL" --eval-iters 4 \
  --log-dir "$OUT/tensorboard" --metrics-jsonl "$OUT/metrics.jsonl" --save "$OUT/checkpoints" 2>&1 |
  grep --line-buffered -v -e '^\[20' -e 'Warning' -e 'warnings.warn' -e '^  return func' ||
  { echo "quickstart: training failed (exit status ${PIPESTATUS[0]})" >&2; exit 1; }

CHECKPOINT="$OUT/checkpoints/$(cat "$OUT/checkpoints/latest")"
say "5/5 text generated from $CHECKPOINT"
n=0
for prompt in "The " "A list comprehension"; do
  n=$((n + 1))
  echo "=== sample $n: prompt '$prompt' ==="
  $PY -m megamamba.generate --checkpoint "$CHECKPOINT" --prompt "$prompt" --max-new-tokens 60 \
    --temperature 0.8 --top-k 40 --seed "$n"
done

printf '\n== done in %ds. TensorBoard: .venv/bin/tensorboard --logdir %s\n' "$SECONDS" "$OUT/tensorboard"
