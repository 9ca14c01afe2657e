#!/usr/bin/env bash
# Issue #9's several-GPU measurements, in parts that each fit one device call (one command, at most 10
# minutes; a session has 30 minutes of device time, so the whole set takes two sessions):
#   bash benchmarks/multi_gpu.sh OUT PART      one part a call; several parts share one BUDGET_S, in the order given
#   bash benchmarks/multi_gpu.sh OUT           every part in the default order below, as far as BUDGET_S lasts
# Parts, most important first; the estimates (on H200s, from the one-GPU seed tables' launch times:
# see docs/benchmarks.md, "Not measured yet") include the ~30 s of setup:
#   parity            2 GPUs, GPT-2 XL, fp32, no warm-up, 20 steps from the same weights: zerofit stages 1-3
#                     against DDP (the zerofit rows under TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=WARN,
#                     every row with a 120 s process group timeout, so a hang ends its row in about two
#                     minutes; one table from the two runs OUT/parity_2gpu.{ddp,debug})           ~3 min
#   seed-cls          the seed's Table 1 on 2 GPUs capped at 24 GiB each: DDP, zerofit ZeRO-2, DeepSpeed ZeRO-2
#   seed-seq2seq      the same for Table 2. Largest-batch searches: every out-of-memory with 2 processes is a
#                     relaunch; each part ~8 min, the DeepSpeed row last and the one BUDGET_S cuts
#   scaling-clm       step time at the equal batch (16 x 128 a GPU), GPT-2 XL, bf16, on NPROC GPUs (default:
#                     all the machine has): ddp, zerofit-s0..s3, fsdp2, deepspeed-s3, -s2, -s1  ~7-8 min
#   scaling-llama7b   the same on the Llama-2-7B architecture (4 x 512 a GPU): ddp, zerofit-s0..s3, fsdp2  ~5-6 min
#   scaling-llama7b-deepspeed   its DeepSpeed rows (stage 3, 2, 1); join the two with
#                     zerofit bench --merge OUT1/scaling-llama7b_8gpu OUT2/scaling-llama7b-deepspeed_8gpu --out J  ~5-6 min
# Pick the GPU count of a scaling part by the machine kind (nvidia-h200-x2, -x4, -x8) or NPROC.
# Every row runs with --timeout (240 s; 300 s for Llama-2-7B) and --budget (what is left of BUDGET_S), so
# no process runs past the deadline; a row that fails, times out or finds no time left is a row saying so
# (`zerofit bench` rewrites OUT/<part>_<N>gpu/{tables.md,results.json} after every row), and the next part
# still runs. OUT/parts.md says how each part ended; everything printed is in OUT/log.
# DeepSpeed comes from the wheels in .whl/ (../shared/ANCHORS.md: cp ../shared/wheels/*.whl .whl/ and
# carry .whl); without them the DeepSpeed rows say "skipped". Settings (environment):
#   BUDGET_S    seconds for everything (450: a call of at most 10 minutes, with room for starting it)
#   NPROC       processes (GPUs) of the scaling parts (default: every GPU, at most 8); parity and seed use 2
#   METHODS     the rows of every part run (default: each part's own list, in the order above), e.g. the
#               rows a part's BUDGET_S cut, in a second call; join the two with `zerofit bench --merge`
#   PYTHON      the interpreter (python3); DS_SITE where the wheels go (/tmp/site)
#   CPU_CHECK=1 every part on CPU on toy sizes (--tiny --cpu), 2 gloo processes, 2 steps: checks this
#               script (parts, flags, budget, tables) without a GPU; the 24 GiB cap and NCCL are not exercised
set -uo pipefail
OUT="${1:-out/multi_gpu}"; shift
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(parity seed-cls seed-seq2seq scaling-clm scaling-llama7b scaling-llama7b-deepspeed)
mkdir -p "$OUT"
: > "$OUT/log"
: > "$OUT/parts.tsv"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
CPU_CHECK="${CPU_CHECK:-0}" PYTHON="${PYTHON:-python3}" DS_SITE="${DS_SITE:-/tmp/site}"
if [ "$CPU_CHECK" = 1 ]; then
  BUDGET_S="${BUDGET_S:-900}"; CHECK=(--tiny --cpu --steps 2 --eval_steps 1)
else
  BUDGET_S="${BUDGET_S:-450}"; CHECK=()
fi
DEADLINE=$(( SECONDS + BUDGET_S ))
export PYTHONPATH="$DS_SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SCALING=(ddp zerofit-s0 zerofit-s1 zerofit-s2 zerofit-s3 fsdp2)
PEERS=(deepspeed-s3 deepspeed-s2 deepspeed-s1)

setup() {
  echo "== multi_gpu.sh $(date -u +%FT%TZ): parts ${PARTS[*]}; BUDGET_S=$BUDGET_S"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$DS_SITE" .whl/*.whl \
      || echo "the .whl/ wheels did not install: the DeepSpeed rows will say skipped"
  else
    echo "no .whl/*.whl: the DeepSpeed rows will say skipped (cp ../shared/wheels/*.whl .whl/ and carry .whl)"
  fi
  if [ "$CPU_CHECK" = 1 ]; then
    GPUS=2
  else
    # DeepSpeed's JIT op builder cannot parse arch names like "9.0a": give it the plain compute capability.
    TORCH_CUDA_ARCH_LIST="$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
    export TORCH_CUDA_ARCH_LIST
    GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  SCALE_N="${NPROC:-$(( GPUS < 8 ? GPUS : 8 ))}"
}

bench() {  # bench DIR [VAR=VALUE...] -- FLAGS...: one `zerofit bench` within what is left of BUDGET_S; sets rc
  local dir="$1" envs=() left
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  left=$(( DEADLINE - SECONDS ))
  # `zerofit bench` keeps 30 s back to stop a process and starts one only with 30 s more left
  if (( left < 90 )); then rc="skipped: ${left}s of BUDGET_S=$BUDGET_S left, a run needs 90"; return; fi
  echo "== $dir: ${envs[*]} zerofit bench $*; ${left}s left"
  # --budget ends the rows in time; timeout is the backstop should `zerofit bench` itself hang.
  timeout -k 20 "$(( left - 10 ))" env "${envs[@]}" "$PYTHON" -m zerofit.cli.main bench "$@" \
    --budget "$(( left - 25 ))" --out "$dir" "${CHECK[@]}"
  rc=$?
}

part() {  # part NAME: its `zerofit bench` run(s); how it ended is a line of parts.tsv
  local name="$1" n=2 limit=240 methods args dir start=$SECONDS rc status
  case "$name" in
    parity) methods=(ddp zerofit-s1 zerofit-s2 zerofit-s3)
      args=(--tables clm --equal_only --mixed_precision no --warmup 0 --steps 20 --eval_steps 1
            --process_group_timeout 120) ;;
    seed-cls|seed-seq2seq) methods=(ddp zerofit-s2 deepspeed-s2)
      args=(--tables "${name#seed-}" --gpu_memory_gib 24 --steps 3 --eval_steps 2) ;;
    scaling-clm) n=$SCALE_N; methods=("${SCALING[@]}" "${PEERS[@]}")
      args=(--tables clm --equal_only --steps 5 --eval_steps 1) ;;
    scaling-llama7b|scaling-llama7b-deepspeed) n=$SCALE_N; limit=300; methods=("${SCALING[@]}")
      [ "$name" = scaling-llama7b-deepspeed ] && methods=("${PEERS[@]}")
      args=(--tables llama7b --equal_only --steps 5 --eval_steps 1) ;;
    *) printf '%s\t-\tunknown part (parity, seed-cls, seed-seq2seq, scaling-clm, scaling-llama7b, %s)\t0\n' \
         "$name" "scaling-llama7b-deepspeed" >> "$OUT/parts.tsv"; return ;;
  esac
  [ -n "${METHODS:-}" ] && read -r -a methods <<< "$METHODS"
  dir="$OUT/${name}_${n}gpu"
  rm -rf "$dir" "$dir".*  # an earlier run's rows must not join this one's table
  args=(--num_processes "$n" "${args[@]}" --timeout "$limit")
  if (( GPUS < n )); then
    rc="skipped: needs $n GPUs, this machine has $GPUS"
  elif [ "$name" = parity ]; then
    parity "$dir" "${methods[@]}"
  else
    bench "$dir" -- "${args[@]}" --methods "${methods[@]}"
  fi
  case "$rc" in
    0) status=ok
       grep -q '| skipped: --budget' "$dir/tables.md" 2>/dev/null && status="ok; rows skipped, BUDGET_S spent" ;;
    1) status="some rows failed or timed out: $dir/tables.md" ;;
    124|137) status="stopped at BUDGET_S (timeout): what finished is in $dir" ;;
    skipped*) status="$rc" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$dir" "$status" "$(( SECONDS - start ))" >> "$OUT/parts.tsv"
}

parity() {  # parity DIR METHOD...: DDP, the reference, plainly; the rows under test under DETAIL; one table
  # DETAIL checks that every rank calls the same collectives with the same shapes. It stays off for DDP:
  # with torch 2.13 on gloo, DDP under DETAIL dies of SIGSEGV while it is constructed.
  local dir="$1" ours=() m runs=() worst=0
  shift
  for m in "$@"; do [ "$m" = ddp ] || ours+=("$m"); done
  if [ "${#ours[@]}" -lt "$#" ]; then
    bench "$dir.ddp" -- "${args[@]}" --methods ddp
    worst=$rc
    runs+=("$dir.ddp") && join "$dir" "${runs[@]}"
  fi
  if [ "${#ours[@]}" -gt 0 ]; then
    bench "$dir.debug" TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=WARN -- "${args[@]}" --methods "${ours[@]}"
    [ "$worst" = 0 ] && worst=$rc
    runs+=("$dir.debug") && join "$dir" "${runs[@]}"
  fi
  rc=$worst
}

join() {  # join OUT RUN...: the runs that wrote results, as one table in OUT
  local out="$1" run wrote=()
  shift
  for run in "$@"; do [ -f "$run/results.json" ] && wrote+=("$run"); done
  if [ "${#wrote[@]}" -gt 0 ]; then
    "$PYTHON" -m zerofit.cli.main bench --merge "${wrote[@]}" --out "$out" > /dev/null || echo "joining ${wrote[*]} failed"
  fi
}

summarize() {  # OUT/parts.md: how each part ended, then each part's table as `zerofit bench` last wrote it
  {
    echo "| part | results | status | wall s |"
    echo "|---|---|---|---|"
    while IFS=$'\t' read -r name dir status wall; do
      echo "| $name | ${dir#"$OUT"/} | $status | $wall |"
    done < "$OUT/parts.tsv"
    while IFS=$'\t' read -r name dir _; do
      [ -f "$dir/tables.md" ] && { echo; echo "## $name"; echo; cat "$dir/tables.md"; }
    done < "$OUT/parts.tsv"
  } > "$OUT/parts.md"
}

main() {
  setup
  for name in "${PARTS[@]}"; do
    part "$name"
    summarize
  done
  echo "== parts ($OUT/parts.md; ${SECONDS}s in all)"
  cat "$OUT/parts.md"
}

main 2>&1 | tee -a "$OUT/log"
