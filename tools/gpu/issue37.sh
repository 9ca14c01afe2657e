#!/usr/bin/env bash
# Issue #37's GPU checks in ONE device call: the engine's GPU tests on this tree (with the new loops file:
# plain loss.backward() and Muon + AdamW on CUDA), then benchmarks/muon_gpu.sh (Muon + AdamW on a from_pretrained
# checkpoint: plain PyTorch beside zerofit ZeRO-2 + GPU-stepped offload and ZeRO-3). Log: $OUT/log.
set -uo pipefail
. "$(dirname "$0")/../../benchmarks/preamble.sh" "${1:-}" out/issue37
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
echo "== GPU tests ($(date -u +%T))"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_engine_loops_gpu.py \
  tests/test_fake_world_gpu.py 2>&1 | tail -15
echo "== muon bench ($(date -u +%T))"
timeout 330 bash benchmarks/muon_gpu.sh "$OUT_DIR/muon"
echo "== done ($(date -u +%T))"
