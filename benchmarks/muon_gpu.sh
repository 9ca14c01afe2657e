#!/usr/bin/env bash
# Muon + AdamW on a from_pretrained checkpoint (issue #37), in ONE device call: plain PyTorch on one GPU beside
# zerofit ZeRO-2 + GPU-stepped optimizer offload and ZeRO-3, each in fp32 (losses compared) and bf16 (timed).
#   bash benchmarks/muon_gpu.sh [--dry] [OUT_DIR]     (OUT_DIR defaults to $OUT, else out/muon)
# Writes a Llama-shaped checkpoint first (benchmarks/trainer_clm.py --make_checkpoint; SHAPE overrides its flags),
# then runs benchmarks/muon.py per row; every record lands in OUT_DIR/*.json, the log in OUT_DIR/log, a table at the
# end. --dry: the same rows on the CPU with a tiny model and 2 gloo processes for the zerofit rows.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
. "$(dirname "$0")/preamble.sh" "${1:-}" out/muon
CKPT=/tmp/muon_ckpt
if (( DRY )); then
  SHAPE="${SHAPE:---hidden 64 --layers 2 --heads 4 --intermediate 128 --vocab 512}"
  RUN=(--steps 4 --warmup 1 --batch 2 --seq 32)
  LAUNCH=(--cpu --num_processes 2)
else
  SHAPE="${SHAPE:---hidden 1536 --layers 16 --heads 12 --intermediate 4096 --vocab 32000}"
  RUN=(--steps 12 --warmup 4 --batch 4 --seq 512)
  LAUNCH=(--num_processes 1)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
"$PY" benchmarks/trainer_clm.py --make_checkpoint "$CKPT" $SHAPE || exit 1
cat > /tmp/muon_s2.yaml <<'YAML'
zero:
  stage: 2
  offload_optimizer:
    device: cpu
    step_on: device
YAML
if (( DRY )); then sed -i 's/step_on: device/step_on: host/' /tmp/muon_s2.yaml; fi
printf 'zero:\n  stage: 3\n' > /tmp/muon_s3.yaml
for prec in fp32 bf16; do
  flag=(); mp=no
  if [ "$prec" = bf16 ]; then flag=(--bf16); mp=bf16; fi
  (( DRY )) && [ "$prec" = bf16 ] && continue
  timeout 240 "$PY" benchmarks/muon.py --model "$CKPT" "${RUN[@]}" "${flag[@]}" --result "$OUT_DIR/torch_$prec.json"
  for cfg in s2 s3; do
    timeout 240 "$PY" -m zerofit.cli.main launch --config_file /tmp/muon_$cfg.yaml "${LAUNCH[@]}" --mixed_precision $mp \
      benchmarks/muon.py --model "$CKPT" --zerofit "${RUN[@]}" --result "$OUT_DIR/zerofit_${cfg}_$prec.json"
  done
done
"$PY" - "$OUT_DIR" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
rows = {f[:-5]: json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")}
print("\n| run | median s/step | GPU peak GiB | last loss | max rel. loss diff vs torch (same precision) |")
print("|---|---|---|---|---|")
for name, r in rows.items():
    ref = rows.get("torch_" + name.rsplit("_", 1)[-1])
    diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) if ref else float("nan")
    peak = r["gpu_peak_gib"]
    print(f"| {name} | {r['median_s']:.4f} | {peak if peak is None else round(peak, 2)} | {r['losses'][-1]:.5f} | {diff:.2e} |")
PYEOF
