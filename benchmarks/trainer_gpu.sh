#!/usr/bin/env bash
# Issue #26: one transformers Trainer script on a pretrained (on-disk) model, zerofit beside DeepSpeed:
#   bash benchmarks/trainer_gpu.sh OUT_DIR     (one GPU, one device call: no run goes on past BUDGET_S seconds)
# The script is benchmarks/trainer_clm.py: a Llama-shaped model from bf16 safetensors, 8x512 synthetic tokens,
# bf16, max_steps STEPS. The runs differ in one import and the launcher, and read the same DeepSpeed JSON
# (the "auto" keys Trainer fills, an AdamW optimizer section):
#   zerofit-s3-offload    zerofit launch --config_file zero3_offload.json trainer_clm.py --trainer zerofit
#   deepspeed-s3-offload  torchrun trainer_clm.py --trainer hf --deepspeed zero3_offload.json
#   zerofit-s2-offload, deepspeed-s2-offload: the same with zero2_offload.json, while the budget lasts.
# A run that fails, times out or finds no time left is a row saying so; the next runs still run. After
# every run OUT_DIR/results.{json,md} are rewritten; each run's record and full log are in OUT_DIR/runs,
# the JSON files in OUT_DIR/configs, everything printed in OUT_DIR/log.
# DeepSpeed comes from the wheels in .whl/ (../shared/ANCHORS.md: cp ../shared/wheels/*.whl .whl/ and
# carry .whl). Settings (environment):
#   HIDDEN LAYERS HEADS INTER VOCAB   the model (2048 24 16 5504 32000: 1.35 B parameters)
#   STEPS WARMUP BATCH SEQ NPROC      12 steps, the median over those after 3, 8x512 a process, 1 process
#   RUNS BUDGET_S                     the four runs above in that order; 530 s for everything
#   CKPT DS_SITE                      the checkpoint folder (built once, then reused); /tmp/site
#   CPU_CHECK=1                       a tiny model on CPU, NPROC=2, fp32: checks this script without a GPU
set -uo pipefail
OUT="${1:-out/trainer_gpu}"
mkdir -p "$OUT/runs" "$OUT/configs"
: > "$OUT/log"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
CPU_CHECK="${CPU_CHECK:-0}"
if [ "$CPU_CHECK" = 1 ]; then
  : "${HIDDEN:=64}" "${LAYERS:=2}" "${HEADS:=4}" "${INTER:=172}" "${VOCAB:=1000}" "${STEPS:=6}"
  : "${BATCH:=4}" "${SEQ:=64}" "${NPROC:=2}"
  LAUNCH_CPU=(--cpu); SCRIPT_CPU=(--cpu --no-bf16)
else
  LAUNCH_CPU=(); SCRIPT_CPU=()
fi
HIDDEN="${HIDDEN:-2048}" LAYERS="${LAYERS:-24}" HEADS="${HEADS:-16}" INTER="${INTER:-5504}"
VOCAB="${VOCAB:-32000}" STEPS="${STEPS:-12}" WARMUP="${WARMUP:-3}" BATCH="${BATCH:-8}" SEQ="${SEQ:-512}"
NPROC="${NPROC:-1}" BUDGET_S="${BUDGET_S:-530}" DS_SITE="${DS_SITE:-/tmp/site}"
read -r -a RUNS <<< "${RUNS:-zerofit-s3-offload deepspeed-s3-offload zerofit-s2-offload deepspeed-s2-offload}"
CKPT="${CKPT:-/tmp/trainer_gpu_llama_h${HIDDEN}_l${LAYERS}_a${HEADS}_i${INTER}_v${VOCAB}}"
DEADLINE=$(( SECONDS + BUDGET_S ))
# Every run sees the same packages: the wheels first (as ANCHORS.md says), src/ should `pip install -e` fail.
export PYTHONPATH="$DS_SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
. benchmarks/beside_deepspeed.sh

setup() {
  echo "== trainer_gpu.sh $(date -u +%FT%TZ): $CKPT, ${BATCH}x$SEQ, $STEPS steps, $NPROC process(es) a run"
  install_tree
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target "$DS_SITE" .whl/*.whl \
      || echo "the .whl/ wheels did not install: the DeepSpeed rows will fail"
  else
    echo "no .whl/*.whl: the DeepSpeed rows will fail (cp ../shared/wheels/*.whl .whl/ and carry .whl)"
  fi
  gpu_arch
  if [ -f "$CKPT/config.json" ]; then
    echo "checkpoint $CKPT exists: reused"
  else
    timeout 300 python3 benchmarks/trainer_clm.py --make_checkpoint "$CKPT" --hidden "$HIDDEN" --layers "$LAYERS" \
      --heads "$HEADS" --intermediate "$INTER" --vocab "$VOCAB" --seq "$SEQ" "${SCRIPT_CPU[@]}" \
      || echo "building the checkpoint failed: every run will fail"
  fi
  du -sh "$CKPT"
  write_configs
}

write_configs() {  # what a Trainer + DeepSpeed user writes: "auto" wherever Trainer knows the value
  local stage extra
  for stage in 2 3; do
    extra=''
    [ "$stage" = 3 ] && extra='
    "offload_param": {"device": "cpu", "pin_memory": true},
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_gather_16bit_weights_on_model_save": true,'
    ds_json "$OUT/configs/zero${stage}_offload.json" "$ADAMW_AUTO" "$(cat <<EOF
    "stage": $stage,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},$extra
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": "auto"
EOF
)"
  done
}

run() {  # run NAME (ENGINE-sSTAGE-offload): one row; a failure is recorded, never fatal
  local name="$1" engine="${1%%-*}" stage="${1#*-s}" limit cmd
  stage="${stage%%-*}"
  local config="$OUT/configs/zero${stage}_offload.json" runs="$OUT/runs"
  local script=(benchmarks/trainer_clm.py --model "$CKPT" --steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH"
                --seq "$SEQ" --output_dir "/tmp/trainer_gpu_$name" --result "$runs/$name.json"
                "${SCRIPT_CPU[@]}")
  case "$engine" in
    zerofit) limit=180; cmd=(python3 -m zerofit.cli.main launch "${LAUNCH_CPU[@]}" --config_file "$config"
                             --num_processes "$NPROC" "${script[@]}" --trainer zerofit) ;;
    deepspeed) limit=240; cmd=(python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC"
                               "${script[@]}" --trainer hf --deepspeed "$config") ;;
    *) echo "unknown run $name: zerofit-sN-offload or deepspeed-sN-offload" > "$runs/$name.status"; return ;;
  esac
  rm -f "$runs/$name.json"
  timed_row "$name" "$runs" "$limit" "${cmd[@]}"
  rm -rf "/tmp/trainer_gpu_$name"
}

summarize() {  # OUT/results.json and OUT/results.md from the runs so far; the table on stdout
  python3 - "$OUT" "${RUNS[@]}" <<'PY'
import os, sys

sys.path.insert(0, "benchmarks")  # records.py (the script runs from the repository root)
from records import cell, peak_cell, run_rows, settings, table, write_results

out, names = sys.argv[1], sys.argv[2:]
rows = run_rows(os.path.join(out, "runs"), names)
body = []
for r in rows:
    rec = r["record"]
    body.append([r["run"], r["status"], cell(rec, "median_step_s", "{:.3f}"), cell(rec, "tokens_per_s", "{:,.0f}"),
                 peak_cell(rec, "gpu_peak_train_gib"), cell(rec, "host_rss_peak_gib", "{:.1f}"),
                 cell(rec, "first_loss", "{:.4f}"), cell(rec, "final_loss", "{:.4f}"), cell(rec, "setup_s", "{:.0f}"),
                 r["wall_s"] or "-"])
md = table(["run", "status", "median s / step", "tokens / s", "GPU peak GiB (in training)", "host RSS GiB",
            "first loss", "final loss", "setup s", "wall s"], body)
records = {r["run"]: r["record"] for r in rows}
ratios = {}
for name in names:
    peer = "deepspeed-" + name[len("zerofit-"):]
    if name.startswith("zerofit-") and records.get(name) and records.get(peer):
        ratios[f"{peer} / {name}"] = records[peer]["median_step_s"] / records[name]["median_step_s"]
md += [""] + [f"step time {k}: {v:.2f}x" for k, v in ratios.items()]
md += [f"{r['run']}: {r['error']}" for r in rows if r["error"]]
keys = ("model", "parameters", "model_config", "world_size", "per_device_batch", "seq", "steps", "warmup",
        "bf16", "versions", "hardware")
write_results(out, {"settings": settings(rows, keys), "ratios": ratios, "runs": rows}, md)
PY
}

rows_main 2>&1 | tee -a "$OUT/log"
