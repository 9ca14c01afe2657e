#!/usr/bin/env bash
# The offload benchmark of README "Benchmarks" on one GPU, peers in the same run (one device call).
#   bash benchmarks/offload_gpu.sh OUT_DIR [clip|noclip|scale|steps|tests]
# clip:   GPT-2 XL 16x128, clipping 1.0: plain PyTorch, zerofit ZeRO-2/3 offload, DeepSpeed, FSDP2
# noclip: the same without clipping (zerofit's host steps then start during backward)
# scale:  the largest Llama-style model with ZeRO-3 + full CPU offload, and GPT-2 XL under a 24 GiB cap
# steps:  GPT-2 XL clip 1.0, offload stepped on the GPU (the default on CUDA) and on the host, DeepSpeed
# tests:  the GPU tests (GPU-stepped offload bit-identical to no offload), two ranks on one GPU via gloo
# split:  GPT-2 XL clip 1.0, GPU-stepped offload with a share of the state host-stepped at once (0 to 0.7)
# auto:   stage: auto (the planner's mix of GPU-resident and offloaded state): 6.7 B Llama 8x512 and GPT-2 XL
#         batch 32 under a 24 GiB cap; this machine's offload rates first
# big:    stage: auto on the 13 B Llama-2 architecture 8x512 (activation checkpointing: on, then off)
# bigpeer: DeepSpeed's best try at the 13 B model (ZeRO-3, optimizer state partly offloaded, checkpointing)
# rows:   issue #19's GPT-2 XL rows, peers beside: ZeRO-2/3 offload 16x128 (DeepSpeed, FSDP2), and
#         stage: auto at batch 32 under a 24 GiB cap (DeepSpeed ZeRO-3 offload beside); the rates first
# rowsfinal: the capped stage: auto row (DeepSpeed beside), the 6.7 B full offload and the 13 B stage: auto
# rowsbig: issue #19's Llama rows: 6.7 B full offload forced, 6.7 B and 13 B stage: auto (checkpointing
#         left to the planner)
# DeepSpeed comes from wheels in .whl/ when present (see ../shared/ANCHORS.md).
set -uo pipefail
OUT="${1:-out/offload_gpu}"; WHAT="${2:-clip}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
B="python3 benchmarks/engine_step.py"
case "$WHAT" in
  clip)
    $B --methods zerofit-s2-offload zerofit-s3-offload torch deepspeed-s2-offload deepspeed-s3-offload fsdp2-offload \
       --steps 6 --timeout 200 --out "$OUT/clip" ;;
  noclip)
    $B --methods zerofit-s2-offload zerofit-s3-offload deepspeed-s2-offload --clip 0 --steps 6 --timeout 200 \
       --out "$OUT/noclip" ;;
  steps)
    $B --methods zerofit-s2-offload zerofit-s2-offload-host deepspeed-s2-offload zerofit-s3-offload \
       zerofit-s3-offload-host deepspeed-s3-offload --steps 6 --timeout 200 --out "$OUT/steps" ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    python3 benchmarks/two_ranks_one_gpu.py 2>&1 | tail -25 | tee "$OUT/two_ranks.txt" ;;
  split)
    for share in 0 0.35 0.55 0.7; do
      $B --methods zerofit-s2-offload --host-share $share --steps 6 --timeout 120 --out "$OUT/split_s2_$share"
    done
    $B --methods zerofit-s3-offload --host-share 0.55 --steps 6 --timeout 120 --out "$OUT/split_s3_0.55" ;;
  auto)
    python3 benchmarks/bandwidth_probe.py > "$OUT/bandwidth.json"; cat "$OUT/bandwidth.json"
    $B --methods zerofit-auto --model llama --n_embd 4096 --n_layer 32 --n_head 32 --intermediate 11008 \
       --batch 8 --seq 512 --steps 3 --meta --timeout 300 --out "$OUT/llama7b_auto"
    $B --methods zerofit-auto --gpu-memory-gib 24 --batch 32 --steps 4 --timeout 150 --out "$OUT/cap24_auto" ;;
  big)
    python3 benchmarks/bandwidth_probe.py > "$OUT/bandwidth_big.json"  # the cache the planner's host share reads
    L13="--model llama --n_embd 5120 --n_layer 40 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --steps 2 --meta"
    $B --methods zerofit-auto $L13 --checkpointing --timeout 280 --out "$OUT/llama13b_auto_ckpt"
    $B --methods zerofit-auto $L13 --timeout 280 --out "$OUT/llama13b_auto" ;;
  bigpeer)
    $B --methods deepspeed-s3-offload --model llama --n_embd 5120 --n_layer 40 --n_head 40 --intermediate 13824 \
       --batch 8 --seq 512 --steps 2 --checkpointing --offload-ratio 0.5 --timeout 500 --out "$OUT/llama13b_deepspeed" ;;
  rows)
    python3 benchmarks/bandwidth_probe.py > "$OUT/bandwidth.json"; cat "$OUT/bandwidth.json"
    $B --methods zerofit-s2-offload zerofit-s3-offload deepspeed-s2-offload deepspeed-s3-offload fsdp2-offload \
       --steps 6 --timeout 200 --out "$OUT/gpt2xl"
    $B --methods zerofit-auto deepspeed-s3-offload --gpu-memory-gib 24 --batch 32 --steps 4 --timeout 200 \
       --out "$OUT/cap24_auto" ;;
  rowsfinal)
    python3 benchmarks/bandwidth_probe.py > "$OUT/bandwidth.json"
    $B --methods zerofit-auto deepspeed-s3-offload --gpu-memory-gib 24 --batch 32 --steps 4 --timeout 200 \
       --out "$OUT/cap24_auto"
    L7="--model llama --n_embd 4096 --n_layer 32 --n_head 32 --intermediate 11008 --batch 8 --seq 512 --meta"
    $B --methods zerofit-s3-offload $L7 --steps 3 --timeout 150 --out "$OUT/llama7b_full"
    $B --methods zerofit-auto --model llama --n_embd 5120 --n_layer 40 --n_head 40 --intermediate 13824 \
       --batch 8 --seq 512 --steps 3 --meta --timeout 220 --out "$OUT/llama13b_auto" ;;
  rowsbig)
    python3 benchmarks/bandwidth_probe.py > "$OUT/bandwidth_big.json"
    L7="--model llama --n_embd 4096 --n_layer 32 --n_head 32 --intermediate 11008 --batch 8 --seq 512 --meta"
    $B --methods zerofit-s3-offload $L7 --steps 3 --timeout 200 --out "$OUT/llama7b_full"
    $B --methods zerofit-auto $L7 --steps 4 --timeout 150 --out "$OUT/llama7b_auto"
    $B --methods zerofit-auto --model llama --n_embd 5120 --n_layer 40 --n_head 40 --intermediate 13824 \
       --batch 8 --seq 512 --steps 3 --meta --timeout 220 --out "$OUT/llama13b_auto" ;;
  scale)
    $B --methods zerofit-s3-offload --model llama --n_embd 4096 --n_layer 32 --n_head 32 --intermediate 11008 \
       --batch 8 --seq 512 --steps 2 --meta --timeout 330 --out "$OUT/llama7b"
    $B --methods zerofit-s3-offload --gpu-memory-gib 24 --batch 32 --steps 4 --timeout 120 --out "$OUT/cap24" ;;
esac
