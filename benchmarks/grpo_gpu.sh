#!/usr/bin/env bash
# Issue #38: GRPO with TRL's own scripts/grpo.py on one GPU, zerofit beside TRL + DeepSpeed:
#   bash benchmarks/grpo_gpu.sh OUT_DIR     (one GPU, one device call: no run goes on past BUDGET_S seconds)
# benchmarks/grpo_bench.py writes a Llama-shaped random-init model (bf16 safetensors, a word-level tokenizer
# trained on examples/data, the model's vocabulary the tokenizer's) and a jsonl of short prompts to disk, and
# copies the installed TRL's trl/scripts/grpo.py with one import changed (GRPOTrainer from grpo_bench: the
# zerofit or TRL class with timers around the rollout; docstring of grpo_bench.py). Every run is that script
# with the same arguments: a rule-based reward (--reward_funcs grpo_bench.distinct_words), no vLLM, TRL's
# GRPOConfig defaults otherwise (bf16, gradient checkpointing, beta 0, ds3_gather_for_generation True):
#   zerofit-s3            GRPO_BENCH_TRAINER=zerofit zerofit launch --config_file zero3.json grpo.py ...
#   deepspeed-s3          GRPO_BENCH_TRAINER=trl accelerate launch --config_file zero3.yaml grpo.py ...
#                         (an Accelerate DeepSpeed YAML whose deepspeed_config_file is zero3.json)
#   zerofit-s2-offload    the same with zero2_offload.json (optimizer offload to CPU)
#   deepspeed-s2-offload  its DeepSpeed peer, while the budget lasts (DeepSpeedCPUAdam compiles first: ~1 min)
# zero3.json has no optimizer section (TRL's own ZeRO-3 config has none: Trainer's AdamW is used);
# zero2_offload.json has DeepSpeed's AdamW, which DeepSpeed's CPU offload needs. Each row: median s/step over the
# steps after WARMUP, generation (TRL's _generate) and the rest of the step ("train") apart, GPU peaks, rewards
# and losses. A run that fails, times out or finds no time left is a row saying so; the next runs still run.
# Only three files go to OUT_DIR: results.json (each run's record, status and first error, the configs),
# results.md (the table) and log (everything printed). Scratch (assets, run logs) is under WORK.
# trl, datasets and DeepSpeed come from the wheels in .whl/ (../shared/ANCHORS.md: cp ../shared/wheels/*.whl
# .whl/ and carry .whl). Settings (environment):
#   HIDDEN LAYERS HEADS INTER        the model (2048 24 16 5504: 1.21 B parameters with this vocabulary)
#   STEPS WARMUP BATCH GENS COMPLETION   8 steps, median after 2; 8 completions a step = 2 prompts x 4
#                                    generations; 128 completion tokens at most
#   BETA NPROC RUNS BUDGET_S         TRL's default (0.0); 1 process; the four runs above; 530 s for everything
#   WORK DS_SITE                     /tmp/grpo_gpu (assets reused when there); /tmp/site
#   CPU_CHECK=1                      a tiny model on CPU, NPROC=2, fp32: checks this script without a GPU
#                                    (DeepSpeed rows run where DS_SITE holds an importable deepspeed)
set -uo pipefail
OUT="${1:-out/grpo_gpu}"
mkdir -p "$OUT"
: > "$OUT/log"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
CPU_CHECK="${CPU_CHECK:-0}"
if [ "$CPU_CHECK" = 1 ]; then
  : "${HIDDEN:=64}" "${LAYERS:=2}" "${HEADS:=4}" "${INTER:=172}" "${STEPS:=5}" "${BATCH:=4}" "${COMPLETION:=16}"
  : "${NPROC:=2}"
  LAUNCH_CPU=(--cpu); SCRIPT_CPU=(--use_cpu true --bf16 false --dtype float32); ASSETS_CPU=(--cpu)
  USE_CPU=true
else
  LAUNCH_CPU=(); SCRIPT_CPU=(--dtype bfloat16); ASSETS_CPU=(); USE_CPU=false
fi
HIDDEN="${HIDDEN:-2048}" LAYERS="${LAYERS:-24}" HEADS="${HEADS:-16}" INTER="${INTER:-5504}"
STEPS="${STEPS:-8}" WARMUP="${WARMUP:-2}" BATCH="${BATCH:-8}" GENS="${GENS:-4}" COMPLETION="${COMPLETION:-128}"
BETA="${BETA:-0.0}" NPROC="${NPROC:-1}" BUDGET_S="${BUDGET_S:-530}" DS_SITE="${DS_SITE:-/tmp/site}"
WORK="${WORK:-/tmp/grpo_gpu}"
read -r -a RUNS <<< "${RUNS:-zerofit-s3 deepspeed-s3 zerofit-s2-offload deepspeed-s2-offload}"
ASSETS="$WORK/assets_h${HIDDEN}_l${LAYERS}_a${HEADS}_i${INTER}"
SCRIPT="$WORK/grpo.py" CONFIGS="$WORK/configs" RUNS_DIR="$WORK/runs"
DEADLINE=$(( SECONDS + BUDGET_S ))
# Every run sees the same packages: src/ (should `pip install -e` fail), benchmarks/ (grpo_bench: the copied
# script's GRPOTrainer and the reward function), the machine's own, then the wheels (last, as
# benchmarks/offload_gpu.sh has them on the device: they add what is missing and shadow nothing there).
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}:$DS_SITE"
export GRPO_BENCH_WARMUP="$WARMUP"
HAVE_DEEPSPEED=0
. benchmarks/beside_deepspeed.sh

setup() {
  echo "== grpo_gpu.sh $(date -u +%FT%TZ): $ASSETS, $STEPS steps of $BATCH completions ($GENS a prompt," \
       "<= $COMPLETION tokens), $NPROC process(es) a run"
  mkdir -p "$CONFIGS" "$RUNS_DIR"
  install_tree
  local wheels=()
  for w in .whl/*.whl; do  # the low-bit optimizer packages are not needed here: left out
    case "$(basename "$w")" in torchao-*|bitsandbytes-*) ;; *) [ -f "$w" ] && wheels+=("$w") ;; esac
  done
  if (( ${#wheels[@]} )); then
    python3 -m pip install -q --no-index --no-deps --target "$DS_SITE" "${wheels[@]}" \
      || echo "the .whl/ wheels did not install: runs needing trl, datasets or deepspeed will fail"
  else
    echo "no .whl/*.whl: trl, datasets and deepspeed only if installed (cp ../shared/wheels/*.whl .whl/, carry .whl)"
  fi
  python3 -c "import importlib.metadata as m, trl, datasets; print(*(f'{n} {m.version(n)}' for n in
    ('trl', 'datasets', 'pyarrow', 'fsspec', 'huggingface_hub', 'transformers', 'accelerate', 'torch')))" \
    || echo "trl or datasets is not importable: every run will fail"
  if python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"; then HAVE_DEEPSPEED=1
  else echo "deepspeed is not importable: the DeepSpeed rows are skipped"; fi
  gpu_arch
  if [ -f "$ASSETS/info.json" ]; then
    echo "assets $ASSETS exist: reused"
  else
    timeout 300 python3 benchmarks/grpo_bench.py --make_assets "$ASSETS" --hidden "$HIDDEN" --layers "$LAYERS" \
      --heads "$HEADS" --intermediate "$INTER" "${ASSETS_CPU[@]}" \
      || echo "building the model and prompts failed: every run will fail"
  fi
  du -sh "$ASSETS/model"
  python3 benchmarks/grpo_bench.py --write_script "$SCRIPT" || echo "copying TRL's grpo.py failed: every run will fail"
  write_configs
}

write_configs() {  # what a TRL + DeepSpeed user writes ("auto" wherever Trainer knows the value), and the YAMLs
  local name
  ds_json "$CONFIGS/zero3.json" '' '    "stage": 3,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_gather_16bit_weights_on_model_save": true'
  ds_json "$CONFIGS/zero2_offload.json" "$ADAMW_AUTO" '    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": "auto"'
  # Accelerate reads mixed precision from the JSON when deepspeed_config_file is set (a mixed_precision key
  # here is an error); Trainer's bf16 fills "auto".
  for name in zero3 zero2_offload; do
    cat > "$CONFIGS/$name.yaml" <<EOF
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: $CONFIGS/$name.json
  deepspeed_multinode_launcher: standard
  zero3_init_flag: true
num_machines: 1
num_processes: $NPROC
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: $USE_CPU
EOF
  done
}

run() {  # run NAME (ENGINE-s3 or ENGINE-s2-offload): one row; a failure is recorded, never fatal
  local name="$1" engine="${1%%-*}" limit config
  rm -f "$RUNS_DIR/$name".{json,log,status,wall}  # WORK may hold an earlier call's files
  case "${name#*-}" in
    s3) config=zero3 ;;
    s2-offload) config=zero2_offload ;;
    *) echo "unknown run $name: zerofit- or deepspeed- then s3 or s2-offload" > "$RUNS_DIR/$name.status"; return ;;
  esac
  local script=("$SCRIPT" --model_name_or_path "$ASSETS/model" --dataset_name "$ASSETS/prompts"
                --reward_funcs grpo_bench.distinct_words --output_dir "$WORK/out_$name" --max_steps "$STEPS"
                --per_device_train_batch_size "$BATCH" --num_generations "$GENS"
                --max_completion_length "$COMPLETION" --beta "$BETA" --logging_steps 1 --save_strategy no
                --report_to none --seed 0 --disable_tqdm true "${SCRIPT_CPU[@]}")
  local cmd
  case "$engine" in
    zerofit) limit=180; cmd=(env GRPO_BENCH_TRAINER=zerofit python3 -m zerofit.cli.main launch "${LAUNCH_CPU[@]}"
                             --config_file "$CONFIGS/$config.json" --num_processes "$NPROC" "${script[@]}") ;;
    deepspeed) limit=240; cmd=(env GRPO_BENCH_TRAINER=trl python3 -m accelerate.commands.launch
                               --config_file "$CONFIGS/$config.yaml" "${script[@]}") ;;
    *) echo "unknown run $name: zerofit- or deepspeed- then s3 or s2-offload" > "$RUNS_DIR/$name.status"; return ;;
  esac
  if [ "$engine" = deepspeed ] && [ "$HAVE_DEEPSPEED" != 1 ]; then
    echo "skipped: deepspeed not importable" > "$RUNS_DIR/$name.status"; echo "== $name skipped"; return
  fi
  GRPO_BENCH_RESULT="$RUNS_DIR/$name.json" timed_row "$name" "$RUNS_DIR" "$limit" "${cmd[@]}"
  rm -rf "$WORK/out_$name"
}

summarize() {  # OUT/results.json and OUT/results.md from the runs so far; the table on stdout
  python3 - "$OUT" "$RUNS_DIR" "$CONFIGS" "${RUNS[@]}" <<'PY'
import os, sys

sys.path.insert(0, "benchmarks")  # records.py (the script runs from the repository root)
from records import cell, peak_cell, read, run_rows, settings, table, write_results

out, runs_dir, configs, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
rows = run_rows(runs_dir, names)
body = []
for r in rows:
    rec = r["record"]
    reward = f"{cell(rec, 'first_reward', '{:.3f}')} -> {cell(rec, 'final_reward', '{:.3f}')}" if rec else "-"
    body.append([r["run"], r["status"], cell(rec, "median_step_s", "{:.3f}"), cell(rec, "median_generate_s", "{:.3f}"),
                 cell(rec, "median_train_s", "{:.3f}"), peak_cell(rec, "gpu_peak_generate_gib"),
                 cell(rec, "host_rss_peak_gib", "{:.1f}"), reward, cell(rec, "final_loss", "{:.4f}"),
                 cell(rec, "setup_s", "{:.0f}"), r["wall_s"] or "-"])
md = table(["run", "status", "median s / step", "generate s", "train s", "GPU peak GiB (generating)", "host RSS GiB",
            "reward first -> final", "final loss", "setup s", "wall s"], body)
records = {r["run"]: r["record"] for r in rows}
ratios = {}
for name in names:
    peer = "deepspeed-" + name[len("zerofit-"):]
    ours, theirs = records.get(name), records.get(peer)
    if name.startswith("zerofit-") and ours and theirs:
        for key in ("median_step_s", "median_generate_s", "median_train_s"):
            if ours.get(key) and theirs.get(key):
                ratios[f"{name} / {peer}, {key[len('median_'):-len('_s')]} time"] = ours[key] / theirs[key]
md += [""] + [f"{k}: {v:.2f}x" for k, v in ratios.items()]
md += [f"{r['run']}: {r['error']}" for r in rows if r["error"]]
keys = ("model", "parameters", "model_config", "world_size", "per_device_batch", "num_generations",
        "max_completion_length", "beta", "gradient_checkpointing", "bf16", "ds3_gather_for_generation", "steps",
        "warmup", "versions", "hardware")
listed = sorted(os.listdir(configs)) if os.path.isdir(configs) else []
config_files = {f: read(os.path.join(configs, f)) for f in listed}
write_results(out, {"settings": settings(rows, keys), "ratios": ratios, "runs": rows, "configs": config_files}, md)
PY
}

rows_main 2>&1 | tee -a "$OUT/log"
