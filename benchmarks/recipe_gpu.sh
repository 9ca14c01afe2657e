#!/usr/bin/env bash
# One recipe on a GPU with a real-size random-init model: run_clm_no_trainer.py, GPT-2 XL architecture
# (1.56 B), ZeRO-3 + CPU offload, the shipped text (examples/data) repeated, with the word-level tokenizer
# examples/make_tiny_assets.py trains on it.
#   bash benchmarks/recipe_gpu.sh OUT_DIR [CONFIG]   (needs transformers and datasets; no hub access)
# CONFIG defaults to examples/configs/zerofit/zero3_offload.yaml; a config with `stage: auto` shows the
# planner's choice and the probe of its first step (cap the GPU with ZEROFIT_GPU_MEMORY_GIB=24).
set -euo pipefail
OUT_DIR="${1:-out/recipe_gpu}"
CONFIG="${2:-examples/configs/zerofit/zero3_offload.yaml}"
WORK="$(mktemp -d)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 examples/make_tiny_assets.py "$WORK/assets" >/dev/null
for i in $(seq 40); do cat examples/data/text_train.txt; done > "$WORK/train.txt"
python3 - "$WORK" <<'PY'
import sys
from transformers import AutoTokenizer, GPT2Config
work = sys.argv[1]
tok = AutoTokenizer.from_pretrained(f"{work}/assets/clm/model")
GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=len(tok),
           eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id).save_pretrained(f"{work}/gpt2xl")
tok.save_pretrained(f"{work}/gpt2xl")
PY
python3 -m zerofit.cli.main launch --num_processes 1 --config_file "$CONFIG" \
    examples/run_clm_no_trainer.py --config_name "$WORK/gpt2xl" --tokenizer_name "$WORK/gpt2xl" \
    --train_file "$WORK/train.txt" --validation_file examples/data/text_validation.txt \
    --block_size 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 16 \
    --learning_rate 5e-4 --num_train_epochs 1 --output_dir "$OUT_DIR"
cat "$OUT_DIR/results.json"
