#!/usr/bin/env bash
# Run public Trainer / TRL / PEFT example scripts, changed only in the import of their trainer class,
# under `zerofit launch` with ZeRO-2 and ZeRO-3 + CPU offload, then reload what they saved.
#
#   tools/real_scripts/run_all.sh SCRIPTS_DIR OUT_DIR
#
# SCRIPTS_DIR holds the fetched scripts under these names (they are never committed here):
#   run_glue.py          transformers examples/pytorch/text-classification/run_glue.py
#   run_clm.py           transformers examples/pytorch/language-modeling/run_clm.py
#   run_translation.py   transformers examples/pytorch/translation/run_translation.py (Seq2SeqTrainer)
#   sft.py, dpo.py       trl/scripts/sft.py and trl/scripts/dpo.py
#   reward.py, kto.py, rloo.py, grpo.py  trl/scripts/{reward,kto,rloo,grpo}.py (rloo and grpo with the rule-based --reward_funcs
#                        rewards.vowel_share that make_fixtures.py writes)
#   corda_finetuning.py  peft examples/corda_finetuning/corda_finetuning.py (Trainer + LoRA)
# The transformers scripts import `evaluate`: have it importable (SCRIPTS_DIR/pydeps is put on the path).
#
# Environment:
#   LAUNCHER  zerofit (default): copies with the one import changed, under `zerofit launch --cpu`;
#             ddp: the scripts unchanged under `torchrun --nproc_per_node 2` (the baseline)
#   CONFIGS   zerofit configs to run (default "zero2 zf_zero2 zero3_offload"); any of
#             zero2          tests/fixtures/configs/ds_zero2_auto.json (stage 2, every batch/optimizer key auto;
#                            its WarmupDecayLR replaces Trainer's schedule, so its losses are not DDP's)
#             zero2_plain    a DeepSpeed JSON, stage 2, every batch key auto and no optimizer or scheduler
#                            section (the Trainer's own AdamW and schedule, so its losses are DDP's)
#             zero3_offload  tests/fixtures/configs/ds_zero3_offload.json with stage3_param_persistence_threshold
#                            0, so every unit is sharded whatever "auto" resolves to for the model
#             zero3_offload_shipped  tests/fixtures/configs/ds_zero3_offload.json as it is
#             zf_zero2       a zerofit YAML, stage 2 with no optimizer section (the Trainer's own AdamW)
#             acc_zero2      tests/fixtures/configs/accelerate_zero2.yaml (Accelerate YAML, DeepSpeed stage 2)
#   SCRIPTS   which scripts (default "glue clm translation sft dpo corda"; also reward kto rloo grpo)
#   LAUNCH_FLAGS  flags for `zerofit launch` before the script (default "--cpu"; "" launches as a user does on a
#             machine without GPUs, the script's own --use_cpu saying CPU)
#   EXTRA_ARGS  more arguments for every script (they come last, so they override), e.g. "--use_peft"
#   TAG       names the variant EXTRA_ARGS make: runs are CONFIG+TAG, compared with the baseline's ddp+TAG
#   BASELINE  an OUT_DIR of an earlier LAUNCHER=ddp run to compare losses and weights with
#
# Writes OUT_DIR/{fixtures,scripts,configs,runs,logs}, OUT_DIR/results.tsv and prints the table of
# tools/real_scripts/check_outputs.py. Exits non-zero if any run or reload check failed.
set -uo pipefail

usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
[[ $# -eq 2 ]] || usage
SCRIPTS_DIR=$(realpath "$1")
OUT=$(realpath -m "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LAUNCHER=${LAUNCHER:-zerofit}
CONFIGS=${CONFIGS:-zero2 zf_zero2 zero3_offload}
SCRIPTS=${SCRIPTS:-glue clm translation sft dpo corda}
PYTHON=${PYTHON:-python}

export PYTHONPATH="$ROOT/src${SCRIPTS_DIR:+:$SCRIPTS_DIR/pydeps}${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME="$OUT/hf_home"
export TOKENIZERS_PARALLELISM=false WANDB_DISABLED=true
unset ZEROFIT_CONFIG_FILE

mkdir -p "$OUT"/{scripts,configs,runs,logs}
FIX="$OUT/fixtures"
[[ -f "$FIX/tiny-bart/config.json" ]] || "$PYTHON" "$HERE/make_fixtures.py" "$FIX" || exit 1

declare -A FILE=([glue]=run_glue.py [clm]=run_clm.py [translation]=run_translation.py [sft]=sft.py [dpo]=dpo.py
                 [corda]=corda_finetuning.py [reward]=reward.py [kto]=kto.py [rloo]=rloo.py [grpo]=grpo.py)
LAUNCH_FLAGS=${LAUNCH_FLAGS---cpu}

# The one change a user makes: the trainer class comes from zerofit instead of transformers / trl.
# A name inside a parenthesised `from transformers import (...)` leaves it, and the zerofit import
# follows the closing parenthesis; a one-line `from trl import SFTTrainer, a, b` keeps a and b.
IMPORT_REWRITE='
s/^\( *\)from transformers import \(Trainer\|Seq2SeqTrainer\)$/\1from zerofit.integrations.transformers import \2/
s/^\( *\)from trl import \(SFTTrainer\|DPOTrainer\|RewardTrainer\|KTOTrainer\|RLOOTrainer\|GRPOTrainer\), \(.*\)$/\1from trl import \3\n\1from zerofit.integrations.trl import \2/
s/^\( *\)from trl import \(SFTTrainer\|DPOTrainer\|RewardTrainer\|KTOTrainer\|RLOOTrainer\|GRPOTrainer\)$/\1from zerofit.integrations.trl import \2/
/^from transformers import ($/,/^)$/{
  /^    \(Seq2Seq\)\{0,1\}Trainer,$/{
    s/^    \(.*\),$/\1/
    h
    d
  }
  /^)$/{
    x
    /^\(Seq2Seq\)\{0,1\}Trainer$/{
      s/.*/)\nfrom zerofit.integrations.transformers import &/
      x
      s/.*//
      x
      b
    }
    x
  }
}'
rewrite_import() { sed -e "$IMPORT_REWRITE" "$1"; }

copy_script() {  # name -> path of the copy to run
    local src="$SCRIPTS_DIR/${FILE[$1]}" dst="$OUT/scripts/$LAUNCHER/${FILE[$1]}"
    mkdir -p "$(dirname "$dst")"
    if [[ $LAUNCHER == ddp ]]; then cp "$src" "$dst"; echo "$dst"; return; fi
    rewrite_import "$src" >"$dst"
    local changed
    changed=$(diff "$src" "$dst" | grep -c '^[<>]')
    if ! grep -q '^ *from zerofit.integrations' "$dst" || ((changed > 3)); then
        echo "import rewrite failed for ${FILE[$1]} ($changed lines changed)" >&2; return 1
    fi
    diff -u "$src" "$dst" >"$OUT/scripts/$1.import.diff"
    echo "$dst"
}

config_file() {  # name -> path
    local shipped="$ROOT/tests/fixtures/configs"
    case $1 in
        zero2) echo "$shipped/ds_zero2_auto.json" ;;
        zero3_offload_shipped) echo "$shipped/ds_zero3_offload.json" ;;
        acc_zero2) echo "$shipped/accelerate_zero2.yaml" ;;
        zero3_offload)
            "$PYTHON" - "$shipped/ds_zero3_offload.json" "$OUT/configs/ds_zero3_offload_sharded.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY
            echo "$OUT/configs/ds_zero3_offload_sharded.json" ;;
        zero2_plain)
            printf '{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",\n "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}\n' \
                >"$OUT/configs/ds_zero2_plain.json"
            echo "$OUT/configs/ds_zero2_plain.json" ;;
        zf_zero2)
            printf 'zero:\n  stage: 2\nprecision:\n  mixed_precision: auto\nbatch:\n  train_micro_batch_size_per_gpu: auto\n  gradient_accumulation_steps: auto\ngradient_clipping: auto\n' \
                >"$OUT/configs/zerofit_stage2_auto.yaml"
            echo "$OUT/configs/zerofit_stage2_auto.yaml" ;;
        *) echo "unknown config '$1' (zero2, zero2_plain, zero3_offload, zero3_offload_shipped, zf_zero2, acc_zero2)" >&2
           return 1 ;;
    esac
}

script_args() {  # name output_dir -> the script's own arguments
    local common=(--per_device_train_batch_size 4 --learning_rate 1e-3 --max_steps 4 --logging_steps 1
                  --save_strategy steps --save_steps 4 --report_to none --seed 0 --use_cpu --output_dir "$2")
    case $1 in
        glue) echo --model_name_or_path "$FIX/tiny-bert" --train_file "$FIX/data/mrpc_train.csv" \
                   --validation_file "$FIX/data/mrpc_validation.csv" --do_train --do_eval --max_seq_length 64 \
                   --per_device_eval_batch_size 4 "${common[@]}" ;;
        clm) echo --model_name_or_path "$FIX/tiny-llama" --train_file "$FIX/data/text_train.txt" \
                  --validation_file "$FIX/data/text_validation.txt" --block_size 64 --do_train --do_eval \
                  --per_device_eval_batch_size 4 "${common[@]}" ;;
        translation) echo --model_name_or_path "$FIX/tiny-bart" --train_file "$FIX/translation/train.jsonl" \
                          --validation_file "$FIX/translation/validation.jsonl" --source_lang en --target_lang de \
                          --do_train --do_eval --predict_with_generate --max_source_length 32 --max_target_length 32 \
                          --num_beams 2 --per_device_eval_batch_size 4 "${common[@]}" ;;
        sft) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/sft" --bf16 false "${common[@]}" ;;
        dpo) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/dpo" --bf16 false "${common[@]}" ;;
        reward) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/dpo" --bf16 false "${common[@]}" ;;
        kto) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/kto" --bf16 false "${common[@]}" ;;
        rloo) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/prompts" --bf16 false \
                   --reward_funcs rewards.vowel_share --num_generations 4 --max_completion_length 8 "${common[@]}" ;;
        grpo) echo --model_name_or_path "$FIX/tiny-llama" --dataset_name "$FIX/prompts" --bf16 false --beta 0.1 \
                   --reward_funcs rewards.vowel_share --num_generations 4 --max_completion_length 8 "${common[@]}" ;;
        corda) echo --model_name_or_path "$FIX/tiny-llama" --data_path "$FIX/instruct" --dataset_split train \
                    --dataset_field instruction output --corda_mode False --lora_r 8 --dataloader_num_proc 1 \
                    --model_max_length 128 "${common[@]}" ;;
    esac
}

[[ $LAUNCHER == ddp ]] && CONFIGS=ddp
[[ -f "$OUT/results.tsv" ]] || printf 'script\tconfig\trc\tseconds\toutput_dir\tlog\n' >"$OUT/results.tsv"
failed=0
for name in $SCRIPTS; do
    [[ -n ${FILE[$name]:-} ]] || { echo "unknown script '$name'" >&2; exit 2; }
    copy=$(copy_script "$name") || { failed=1; continue; }
    for cfg in $CONFIGS; do
        label=$cfg${TAG:++$TAG}
        run="$OUT/runs/${name}__$label" log="$OUT/logs/${name}__$label.log"
        rm -rf "$run"
        # shellcheck disable=SC2207  # the paths have no spaces
        args=($(script_args "$name" "$run") ${EXTRA_ARGS:-})
        if [[ $LAUNCHER == ddp ]]; then
            port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
            cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" "$copy" "${args[@]}")
        else
            cfg_path=$(config_file "$cfg") || exit 2
            # shellcheck disable=SC2206  # LAUNCH_FLAGS is a list of flags
            cmd=("$PYTHON" -m zerofit.cli.main launch --config_file "$cfg_path" --num_processes 2 $LAUNCH_FLAGS "$copy"
                 "${args[@]}")
        fi
        echo "== $name / $label"
        # Started in the fixtures folder: `evaluate.load("accuracy")` finds ./accuracy/accuracy.py there.
        # A DDP worker can hang at exit after Accelerate's end_training destroyed the gloo group while
        # DDP's Reducer still holds it (~ProcessGroupGloo joins a thread that never ends): that is the
        # baseline's own flake, so a ddp run that times out is run again; a zerofit hang is a finding.
        for attempt in 1 2 3; do
            start=$(date +%s.%N)
            (cd "$FIX" && printf '%q ' "${cmd[@]}" >"$log" && echo >>"$log" &&
                timeout "$([[ $LAUNCHER == ddp ]] && echo 180 || echo 600)" "${cmd[@]}" >>"$log" 2>&1)
            rc=$?
            [[ $LAUNCHER == ddp && $rc == 124 && $attempt -lt 3 ]] || break
            echo "   timed out (attempt $attempt), running it again"
        done
        seconds=$(echo "$(date +%s.%N) - $start" | bc)
        ((rc == 0)) || { failed=1; echo "   failed (rc $rc), last lines of $log:"; tail -n 15 "$log" | cut -c1-300 | sed 's/^/   | /'; }
        printf '%s\t%s\t%s\t%.1f\t%s\t%s\n' "$name" "$label" "$rc" "$seconds" "$run" "$log" >>"$OUT/results.tsv"
    done
done

"$PYTHON" "$HERE/check_outputs.py" "$OUT" ${BASELINE:+--baseline "$BASELINE"} || failed=1
exit $failed
