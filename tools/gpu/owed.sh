#!/usr/bin/env bash
# The GPU measurements issue #28 still owes, in ONE device call (one H200; torch 2.11, transformers 5.17, no
# network): bash tools/gpu/owed.sh [--dry] [OUT_DIR]   (OUT_DIR defaults to $OUT, else out/owed)
#   a) the GPU tests: tests/test_engine_gpu.py tests/test_fake_world_gpu.py, then `-m gpu tests` (counts)
#   b) `zerofit env --probe`: the bf16 matmul rate that MFU is counted against (bench and progress line)
#   c) the compile table: `zerofit bench --tables clm --equal_only` (GPT-2 XL at one batch) for ddp, zerofit-s2,
#      zerofit-s3, each eager and -compiled (inductor), within --budget; compiled/eager ratios, MFU
#   d) a real progress line: examples/run_clm_no_trainer.py under `zerofit launch` with a stage-2 zerofit YAML
#      (logging.steps_per_print), on a GPT-2 XL checkpoint this script first writes to disk
#      (tools/gpu/gpt2_checkpoint.py: random weights, save_pretrained) and loads with from_pretrained
# Each part runs under `timeout`, against one deadline (BUDGET_S, default 530 s), so a hang costs only its
# part. Everything is tee'd to OUT_DIR/log; the bench's tables.md/results.json land in OUT_DIR/compile; a
# short table closes the log. The example needs `datasets`, which the GPU machine lacks: copy
# ../shared/wheels/{datasets,dill,multiprocess}-*.whl into .whl/ and carry .whl (installed here into /tmp/site).
# --dry: the same parts on CPU at toy sizes (aot_eager, 2 gloo processes for d), to prove the script end to end.
# Settings (environment): PARTS ("a b c d"), BUDGET_S, METHODS, BATCH (16), SIZE (xl), STEPS (d's optimizer
# steps, 40; a progress line every 10), PYTHON.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
. "$(dirname "$0")/../../benchmarks/preamble.sh" "${1:-}" out/owed
export TOKENIZERS_PARALLELISM=false
use_wheels /tmp/site .whl/*.whl
ZF=("$PY" -m zerofit.cli.main)
DEADLINE=$(( SECONDS + ${BUDGET_S:-530} ))
BATCH="${BATCH:-16}" STEPS="${STEPS:-40}" PRINT_EVERY=10
SIZE="${SIZE:-xl}"
read -r -a METHODS <<< "${METHODS:-ddp ddp-compiled zerofit-s2 zerofit-s2-compiled zerofit-s3 zerofit-s3-compiled}"
declare -A SAID

want() { [[ " ${PARTS:-a b c d} " == *" $1 "* ]]; }
left() { echo $(( DEADLINE - SECONDS )); }
# part NAME CAP CMD...: run CMD under `timeout` (its cap, or what is left of the budget), record its exit
part() {
  local name=$1 cap=$2; shift 2
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 15 )); then echo "== $name: skipped, ${t}s of the budget left"; SAID[$name]="skipped (budget)"; return; fi
  echo "== $name ($(date -u +%T), timeout ${t}s): $*"
  local start=$SECONDS
  timeout -k 20 "$t" "$@"
  local rc=$?
  SAID[$name]="exit $rc in $(( SECONDS - start ))s$( ((rc == 124)) && echo ' (timed out)')"
  echo "== $name: ${SAID[$name]}"
}

if (( DRY )); then
  echo "owed.sh --dry: CPU, toy sizes"
  SIZE=tiny STEPS=8 PRINT_EVERY=4
  BENCH=(--tiny --cpu --compile_backend aot_eager --steps 2 --warmup 1 --equal_batch 2)
  METHODS=(ddp ddp-compiled zerofit-s2 zerofit-s2-compiled)
  LAUNCH=(--cpu --num_processes 2 --mixed_precision no)
  PRECISION=no
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  BENCH=(--steps 5 --warmup 2 --equal_batch "$BATCH" --timeout 200)
  LAUNCH=(--num_processes 1)
  PRECISION=bf16
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

# a) GPU tests (skips on CPU)
want a && part tests_gpu_files 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_fake_world_gpu.py
want a && part tests_gpu_mark 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests

# b) the matmul rate MFU is counted against
if want b; then
  if (( DRY )); then part env 60 "${ZF[@]}" env; else part env_probe 60 "${ZF[@]}" env --probe; fi
fi

# c) compiled vs eager, GPT-2 XL, one batch (the bench stops its own rows at --budget, and says which it skipped)
T=$(( $(left) - 140 )); (( T > 320 )) && T=320
want c && part bench_compile $(( T + 30 )) "${ZF[@]}" bench --tables clm --equal_only --eval_steps 0 --methods "${METHODS[@]}" \
  --budget "$T" --out "$OUT_DIR/compile" "${BENCH[@]}"

# d) a real run's progress line: the repo's no_trainer example, a checkpoint loaded with from_pretrained
WORK="${TMPDIR:-/tmp}/owed_clm"
want d && rm -rf "$WORK" && mkdir -p "$WORK" && printf 'zero:\n  stage: 2\nprecision:\n  mixed_precision: %s\ngradient_clipping: 1.0\nlogging:\n  steps_per_print: %s\n' \
  "$PRECISION" "$PRINT_EVERY" > "$WORK/zero2.yaml"
want d && part checkpoint 90 "$PY" tools/gpu/gpt2_checkpoint.py "$WORK" --size "$SIZE" --lines 2000
want d && part progress_line 150 "${ZF[@]}" launch "${LAUNCH[@]}" --config_file "$WORK/zero2.yaml" examples/run_clm_no_trainer.py \
  --model_name_or_path "$WORK/model" --train_file "$WORK/train.txt" --validation_file "$WORK/validation.txt" \
  --block_size 128 --per_device_train_batch_size "$BATCH" --per_device_eval_batch_size "$BATCH" \
  --learning_rate 1e-4 --num_train_epochs 1 --max_train_steps "$STEPS" --seed 0
want d && rm -rf "$WORK"

echo
echo "## owed.sh summary ($(date -u +%T), $(( SECONDS ))s)"
echo "| part | result |"
echo "|---|---|"
for name in tests_gpu_files tests_gpu_mark env env_probe bench_compile checkpoint progress_line; do
  [ -n "${SAID[$name]:-}" ] && echo "| $name | ${SAID[$name]} |"
done
counts=$(grep -E '^[0-9]+ (passed|failed|skipped|deselected)|^=+ .*(passed|failed|skipped)' "$OUT_DIR/log" \
  | grep -v '^| ' | tail -2 | tr '\n' ';')
echo "| pytest counts (files; -m gpu) | ${counts:-none} |"
echo "| matmul rate | $(grep -o 'bf16 matmul [0-9.]* TFLOP/s' "$OUT_DIR/log" | tail -1) |"
echo "| progress line | $(tr '\r' '\n' < "$OUT_DIR/log" | grep -oE 'zerofit: step [0-9]+ \|.*' | tail -1) |"
if [ -f "$OUT_DIR/compile/tables.md" ]; then
  echo; echo "compile table (compiled/eager: the 'vs eager' column, eager s / compiled s):"
  grep -E '^\| (method|ddp|zerofit)' "$OUT_DIR/compile/tables.md"
fi
