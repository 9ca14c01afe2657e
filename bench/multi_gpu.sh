#!/usr/bin/env bash
# Issue #9's several-GPU measurements, for a machine with 2 or more GPUs (one call per part fits the
# device tool's 10-minute limit):
#   bash bench/multi_gpu.sh OUT [seed] [scaling] [parity]        (default: all three)
# seed:    the seed's Tables 1 and 2 on 2 GPUs capped at 24 GiB each: DDP vs zerofit vs DeepSpeed ZeRO-2
# scaling: step time at equal batch of stages 0-3 vs DDP, DeepSpeed and FSDP2 on 2, 4 and 8 GPUs (as many
#          as the machine has): GPT-2 XL and the Llama-2-7B architecture
# parity:  fp32, 20 steps from the same weights: zerofit stages 1-3 against DDP on NCCL
# Each part writes OUT/<part>_<N>gpu/{tables.md,results.json,*.png}. DeepSpeed comes from .whl/ when carried.
set -euo pipefail
out="$1"; shift
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(seed scaling parity)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
gpus="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
if [ "$gpus" -lt 2 ]; then echo "bench/multi_gpu.sh: this machine has $gpus GPU(s); it needs 2 or more" >&2; exit 2; fi
bench() { python3 -m zerofit.cli.main bench "$@" || echo "bench/multi_gpu.sh: a part failed: $*" >&2; }
for part in "${parts[@]}"; do
  case "$part" in
    seed)
      bench --num_processes 2 --gpu-memory-gib 24 --tables cls seq2seq --methods ddp zerofit-s2 deepspeed-s2 \
        --steps 3 --eval-steps 2 --out "$out/seed_2gpu" ;;
    scaling)
      for n in 2 4 8; do
        [ "$n" -le "$gpus" ] || continue
        bench --num_processes "$n" --tables clm llama7b --equal-only --steps 5 --methods ddp zerofit-s0 zerofit-s1 \
          zerofit-s2 zerofit-s3 deepspeed-s1 deepspeed-s2 deepspeed-s3 fsdp2 --out "$out/scaling_${n}gpu"
      done ;;
    parity)
      bench --num_processes 2 --tables clm --equal-only --mixed_precision no --warmup 0 --steps 20 \
        --methods ddp zerofit-s1 zerofit-s2 zerofit-s3 --out "$out/parity_2gpu" ;;
    *) echo "bench/multi_gpu.sh: unknown part $part (seed, scaling, parity)" >&2; exit 2 ;;
  esac
done
