#!/usr/bin/env bash
# The seed's three tables on the lent GPU machine (one H200, capped at 24 GiB like the seed's cards).
#   benchmarks/seed_tables_gpu.sh OUT [TABLES...] [-- extra zerofit bench flags]
# Installs the DeepSpeed wheels carried in .whl/ (see shared/ANCHORS.md) so the DeepSpeed rows run.
set -euo pipefail
out="$1"; shift
tables=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do tables+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#tables[@]} -gt 0 ] || tables=(cls seq2seq clm)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# DeepSpeed's JIT op builder cannot parse arch names like "9.0a": give it the plain compute capability.
export TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
python3 -m zerofit.cli.main bench --gpu-memory-gib 24 --tables "${tables[@]}" --out "$out" "$@"
