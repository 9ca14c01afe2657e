# shellcheck shell=bash
# What the device scripts that run zerofit beside DeepSpeed share (grpo_gpu.sh, trainer_gpu.sh: one row a run,
# every row under one BUDGET_S), sourced after their settings: the DeepSpeed JSON a Trainer user writes, and the
# rows. The script defines `setup` (once), `run NAME` (one row, through timed_row) and `summarize`
# (OUT/results.{json,md} from the rows so far, the table on stdout); `rows_main` calls them in RUNS' order. Needs
# OUT, RUNS, DEADLINE (SECONDS at which the budget ends), BUDGET_S and CPU_CHECK set.

# DeepSpeed's AdamW with every value Trainer knows left "auto" (DeepSpeed's CPU offload needs its own optimizer).
ADAMW_AUTO='
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},'

ds_json() {  # ds_json FILE OPTIMIZER ZERO: OPTIMIZER (empty, or ADAMW_AUTO) and ZERO (the zero_optimization
             # body) inside the keys Trainer fills ("auto") and DeepSpeed's quiet logging
  cat > "$1" <<EOF
{
  "bf16": {"enabled": "auto"},$2
  "zero_optimization": {
$3
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "steps_per_print": 1000000,
  "wall_clock_breakdown": false
}
EOF
}

install_tree() {  # the tree as a package on the GPU machine; a CPU check leaves the developer's environment alone
  if [ "$CPU_CHECK" != 1 ]; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . || echo "pip install -e . failed: src/ used"
  fi
}

gpu_arch() {  # on the GPU machine: TORCH_CUDA_ARCH_LIST from the GPU, and its name, memory and driver
  if [ "$CPU_CHECK" != 1 ]; then
    # DeepSpeed's JIT op builder (DeepSpeedCPUAdam) cannot parse arch names like "9.0a".
    TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
    export TORCH_CUDA_ARCH_LIST
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
}

# timed_row NAME RUNS_DIR LIMIT CMD...: CMD under `timeout` (LIMIT seconds, or what is left of the budget; under
# 60 s left: skipped), its output in RUNS_DIR/NAME.log and, less the per-step deprecation noise, on stdout; then
# RUNS_DIR/NAME.status (ok only with an exit 0 and RUNS_DIR/NAME.json written, which CMD writes) and NAME.wall.
# A failure is recorded, never fatal.
timed_row() {
  local name=$1 runs=$2 limit=$3 left start rc status; shift 3
  left=$(( DEADLINE - SECONDS ))
  if (( left < 60 )); then
    echo "skipped: ${left}s of BUDGET_S=$BUDGET_S left" > "$runs/$name.status"
    echo "== $name skipped"; return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (timeout ${limit}s): $*"
  start=$SECONDS
  timeout -k 20 "$limit" "$@" 2>&1 | tee "$runs/$name.log" \
    | grep --line-buffered -v -e FutureWarning -e 'return func(' -e 'warnings.warn('
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ] && [ -f "$runs/$name.json" ]; then status=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status="timeout after ${limit}s"
  else status="failed (exit $rc)"; fi
  echo "$status" > "$runs/$name.status"
  echo "$(( SECONDS - start ))" > "$runs/$name.wall"
}

rows_main() {  # every row, the results rewritten after each (a later failure keeps the earlier rows), the table
  setup
  for name in "${RUNS[@]}"; do
    run "$name"
    summarize > /dev/null || echo "summarize failed"
  done
  echo "== results ($OUT/results.md; ${SECONDS}s in all)"
  summarize
}
