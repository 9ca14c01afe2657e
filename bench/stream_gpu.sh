#!/usr/bin/env bash
# GPU-stepped offload on one GPU, peers in the same run (one device call each part).
#   bash bench/stream_gpu.sh OUT_DIR [tests|gpt2|scale]
# tests: the GPU tests (bit-identity of GPU-stepped offload), and two ranks on one GPU through gloo
# gpt2:  GPT-2 XL 16x128 clip 1.0: zerofit ZeRO-2/3 offload GPU-stepped and host-stepped, DeepSpeed
# scale: 6.7 B Llama 8x512 full offload (forced), GPT-2 XL under a 24 GiB cap at batch 32
set -uo pipefail
OUT="${1:-out/stream_gpu}"; WHAT="${2:-gpt2}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
B="python3 bench/engine_step.py"
case "$WHAT" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    python3 bench/two_ranks_one_gpu.py 2>&1 | tail -25 | tee "$OUT/two_ranks.txt" ;;
  gpt2)
    $B --methods zerofit-s2-offload zerofit-s2-offload-host deepspeed-s2-offload zerofit-s3-offload \
       zerofit-s3-offload-host deepspeed-s3-offload --steps 6 --timeout 200 --out "$OUT/gpt2" ;;
  scale)
    $B --methods zerofit-s3-offload --model llama --n_embd 4096 --n_layer 32 --n_head 32 --intermediate 11008 \
       --batch 8 --seq 512 --steps 2 --meta --timeout 330 --out "$OUT/llama7b"
    $B --methods zerofit-s3-offload --gpu-memory-gib 24 --batch 32 --steps 4 --timeout 120 --out "$OUT/cap24" ;;
esac
