#!/usr/bin/env bash
# The step time of this checkout beside another checkout of zerofit (BASE: a folder holding its src/ and
# benchmarks/), GPT-2 XL 16x128 bf16 clip 1.0 on one GPU, each method in its own process, both in one call:
#   [STEPS=6] bash benchmarks/compare_gpu.sh BASE OUT_DIR [METHOD ...]   (default: torch zerofit-s2 zerofit-s2-offload zerofit-s3-offload)
# Used for issue #25's cost of leaving unused parameters out of the step (one optimizer tensor per
# parameter part instead of per unit and param group). The two trees alternate, method by method.
set -uo pipefail
BASE="$1"; OUT="$2"; shift 2
METHODS=("${@:-torch zerofit-s2 zerofit-s2-offload zerofit-s3-offload}")
read -r -a METHODS <<< "${METHODS[*]}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for m in "${METHODS[@]}"; do
  for tree in base new; do
    if [ "$tree" = base ]; then root="$BASE"; else root="$PWD"; fi
    PYTHONPATH="$root/src" python3 "$root/benchmarks/engine_step.py" --methods "$m" --steps "${STEPS:-6}" --timeout 200 \
      --out "$OUT/${tree}_$m" 2>&1 | tail -4
  done
done
