#!/usr/bin/env bash
# Issue #39 "Quality": fp32 / bf16 / 8-bit optimizer state and torchao's AdamW8bit, 300 steps of GPT-2 XL on real
# text (benchmarks/state_quality.py says what exactly), every row and the summary in ONE device call:
#   mkdir -p .whl && cp ../shared/wheels/torchao-*.whl .whl/       # here; then on the device, carry [".whl"]:
#   bash benchmarks/state_quality_gpu.sh [--tiny] [OUT_DIR]          # OUT_DIR defaults to $OUT, else out/state_quality
# --tiny: the same rows with a tiny model on the CPU (the check before the device call).
# Rows run two at a time on the one GPU (LANES=1: one at a time), never two whose memory would not fit together
# (GPT-2 XL 16x128, GiB, estimated from engine_step's 34.6 torch / 36.1 zerofit-s2 peaks less the 50257-token
# vocabulary: torch-adamw 32, torchao-8bit 22, zerofit-fp32 35, zerofit-8bit 27, zerofit-bf16 29). Sharing hides
# each row's start (imports, model build, torchao's torch.compile on the CPU) behind another's steps; the GPU's
# work is the same. A row that failed (out of memory) runs again alone while time is left. Training stops BUDGET_S
# (default 320) seconds after the start, whatever is done; the records say so.
# Writes OUT_DIR/<row>.json, OUT_DIR/summary.md, OUT_DIR/state_quality.png (if matplotlib imports), OUT_DIR/log.
set -uo pipefail
TINY=()
if [ "${1:-}" = "--tiny" ]; then TINY=(--tiny); shift; fi
. "$(dirname "$0")/preamble.sh" "${1:-}" out/state_quality
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-320} ))
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if compgen -G ".whl/torchao-*.whl" > /dev/null; then
  rm -rf /tmp/state_quality_site  # pip --target keeps what an earlier call installed there
  use_wheels /tmp/state_quality_site .whl/torchao-*.whl
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# the corpus outside OUT_DIR: the device call brings back at most 8 files (the log, the summary, the plot and the 5
# rows' records fill them), and each row's record describes the corpus (files, sha256) anyway
CORPUS="${CORPUS:-$(mktemp -d)/corpus}"
"$PY" benchmarks/state_quality.py "${TINY[@]}" --build-corpus "$CORPUS" || exit 1

row() {  # one row in its own process; transformers' config notes are dropped from the log
  "$PY" benchmarks/state_quality.py "${TINY[@]}" --row "$1" --corpus "$CORPUS" --out "$OUT_DIR" \
    --deadline "$DEADLINE" 2>&1 | grep -v '^\[transformers\]'
}
# GiB each row is expected to hold at most on the GPU (see the header); rows start in ROWS' order, the first that
# fits beside the running ones under CAP_GIB (default: the GPU's memory less 14 GiB; no GPU: no cap).
declare -A GIB=([torch-adamw]=32 [torchao-8bit]=22 [zerofit-fp32]=35 [zerofit-8bit]=27 [zerofit-bf16]=29)
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -1)
CAP_GIB="${CAP_GIB:-$(( ${TOTAL_MIB:-1048576} / 1024 - 14 ))}"
run_rows() {  # run_rows SLOTS ROW...: at most SLOTS rows at once
  local slots="$1" queue=("${@:2}") pid r i used
  declare -A running=()
  while (( ${#queue[@]} + ${#running[@]} )); do
    for pid in "${!running[@]}"; do
      if ! kill -0 "$pid" 2> /dev/null; then
        wait "$pid"  # this pid only: a bare wait would also wait for the log's tee, which never ends
        echo "${running[$pid]} ended at $(( $(date +%s) - START ))s"
        unset "running[$pid]"
      fi
    done
    used=0
    for pid in "${!running[@]}"; do used=$(( used + GIB[${running[$pid]}] )); done
    if (( ${#running[@]} < slots )); then
      for i in "${!queue[@]}"; do
        r="${queue[$i]}"
        if (( ${#running[@]} == 0 || used + GIB[$r] <= CAP_GIB )); then
          echo "$r starts at $(( $(date +%s) - START ))s beside: ${running[*]:-nothing}"
          row "$r" &
          running[$!]="$r"
          unset "queue[$i]"
          queue=("${queue[@]}")
          break
        fi
      done
    fi
    sleep 1
  done
}
ROWS=(torch-adamw torchao-8bit zerofit-8bit zerofit-fp32 zerofit-bf16)
run_rows "${LANES:-2}" "${ROWS[@]}"
for r in "${ROWS[@]}"; do  # a row with no record, or one that failed (out of memory beside another): again, alone
  if { [ ! -f "$OUT_DIR/$r.json" ] || grep -q '"error"' "$OUT_DIR/$r.json"; } && (( $(date +%s) < DEADLINE )); then
    [ -f "$OUT_DIR/$r.json" ] && mv "$OUT_DIR/$r.json" "$OUT_DIR/$r.failed.json"
    echo "$r: no complete record, running it again alone"
    run_rows 1 "$r"
  fi
done
"$PY" benchmarks/state_quality.py --summary "$OUT_DIR"
rm -f "$CORPUS.bin"  # 41 MiB of text
