#!/usr/bin/env bash
# Issue #29: pretrained Llama-shaped checkpoints from disk under `stage: auto`, as a user's Accelerate loop:
#   bash benchmarks/pretrained_gpu.sh OUT_DIR      (one GPU, one device call; nothing goes on past BUDGET_S)
# For each size in SIZES: write the checkpoint (bf16 safetensors, benchmarks/trainer_clm.py --make_checkpoint),
# run benchmarks/pretrained.py under `zerofit launch` with CONFIG (default: stage auto, bf16), save if SAVE=1,
# then delete the checkpoint (the disk holds one 13 B checkpoint and its save, not two models).
# Settings (environment):
#   SIZES        names from the table below, in order (default "13b")
#   STEPS BATCH SEQ   6 steps, 8x512
#   SAVE=1       save_pretrained after training and check every tensor (needs the model's bf16 size free on disk)
#   HISTORY=1    record CUDA allocations; an OOM writes the largest live ones with their frames
#   MODES        benchmarks/pretrained.py --mode values to run per size, in order (default "train")
#   NO_LOADER=1  prepare(model, optimizer) only: the batch is fed by hand (the planner sees no batch shape)
#   STATE        precision.optimizer_state of the default config: fp32 (default), bf16, 8bit
#   ARGS         more benchmarks/pretrained.py arguments, e.g. "--save-with save_model --check-values --drop-input"
#                (the largest run: the disk holds the checkpoint or its save, not both; every value checked)
#   BUDGET_S     seconds for everything (default 540)
# Each run's JSON record and log land in OUT_DIR; OUT_DIR/log has everything printed.
set -uo pipefail
OUT="${1:-out/pretrained_gpu}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${STEPS:-6}" BATCH="${BATCH:-8}" SEQ="${SEQ:-512}" SAVE="${SAVE:-0}" HISTORY="${HISTORY:-0}"
BUDGET_S="${BUDGET_S:-540}" DEADLINE=$(( SECONDS + ${BUDGET_S:-540} ))
read -r -a MODES <<< "${MODES:-train}"
read -r -a SIZES <<< "${SIZES:-13b}"
CONFIG="${CONFIG:-$OUT/auto.yaml}"
[ -f "$CONFIG" ] || printf 'zero:\n  stage: auto\nprecision:\n  mixed_precision: bf16\n  optimizer_state: %s\n' \
  "${STATE:-fp32}" > "$CONFIG"
read -r -a EXTRA <<< "${ARGS:-}"

shape() {  # hidden layers heads intermediate of a Llama-2-shaped model
  case "$1" in
    1b) echo "2048 16 16 5504" ;;
    6.7b) echo "4096 32 32 11008" ;;
    13b) echo "5120 40 40 13824" ;;
    14b) echo "5120 44 40 13824" ;;
    16b) echo "5120 50 40 13824" ;;
    18b) echo "5120 57 40 13824" ;;
    20b) echo "6144 44 48 16384" ;;
    *) echo "" ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | head -2; df -h /tmp | tail -1
for size in "${SIZES[@]}"; do
  read -r hidden layers heads inter <<< "$(shape "$size")"
  [ -n "${hidden:-}" ] || { echo "unknown size $size"; continue; }
  left=$(( DEADLINE - SECONDS ))
  (( left < 90 )) && { echo "== $size skipped: ${left}s left"; continue; }
  ckpt="/tmp/pretrained_$size"
  echo "== $size: checkpoint $ckpt ($(date -u +%T))"
  [ -f "$ckpt/config.json" ] || timeout 300 python3 benchmarks/trainer_clm.py --make_checkpoint "$ckpt" \
    --hidden "$hidden" --layers "$layers" --heads "$heads" --intermediate "$inter" --seq "$SEQ" | tail -1
  du -sh "$ckpt"
  for mode in "${MODES[@]}"; do
    save=(); [ "$SAVE" = 1 ] && save=(--save "/tmp/pretrained_${size}_saved")
    left=$(( DEADLINE - SECONDS - 10 ))
    (( left < 60 )) && { echo "== $size $mode skipped: ${left}s left"; continue; }
    echo "== $size --mode $mode: train ($(date -u +%T), timeout ${left}s)"
    ZEROFIT_BENCH_MEMORY_HISTORY="$HISTORY" timeout -k 10 "$left" python3 -m zerofit.cli.main launch \
      --config_file "$CONFIG" --num_processes 1 benchmarks/pretrained.py --model "$ckpt" --steps "$STEPS" \
      --batch "$BATCH" --seq "$SEQ" --mode "$mode" --result "$OUT/$size-$mode${NO_LOADER:+-noloader}.json" \
      "${save[@]}" ${NO_LOADER:+--no-loader} "${EXTRA[@]}" 2>&1 \
      | grep --line-buffered -v -e 'Loading weights' -e 'Writing model shards'
    echo "== $size --mode $mode: exit ${PIPESTATUS[0]} ($(date -u +%T))"
    [ -d "/tmp/pretrained_${size}_saved" ] && du -sh "/tmp/pretrained_${size}_saved"
    rm -rf "/tmp/pretrained_${size}_saved"
  done
  [ "${KEEP:-0}" = 1 ] || rm -rf "$ckpt"  # KEEP=1: the next call of this script reuses it
done
