set -uo pipefail
. benchmarks/preamble.sh "$OUT" out/s18
NEW="$PWD/src"; OLD="$PWD/abtest_old/src"
nvidia-smi --query-gpu=name --format=csv,noheader
"$PY" -c 'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__)'
echo "== tests $(date -u +%T)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_engine_gpu.py tests/test_engine_state_dtype_gpu.py tests/test_shard_file.py 2>&1 | tail -8
echo "== codec $(date -u +%T)"
timeout 60 "$PY" benchmarks/codec_speed.py
B="benchmarks/engine_step.py --steps 6 --timeout 140 --optimizer-state 8bit"
for tree in old new; do
  src=$OLD; [ $tree = new ] && src=$NEW
  echo "== xl $tree clip 1 $(date -u +%T)"
  PYTHONPATH=$src timeout 200 "$PY" $B --methods zerofit-s2-offload zerofit-s3-offload --out "$OUT/xl_$tree" | head -4
done
echo "== xl new clip 0 $(date -u +%T)"
PYTHONPATH=$NEW timeout 200 "$PY" $B --methods zerofit-s2-offload zerofit-s3-offload --clip 0 --out "$OUT/xl_new_noclip" | head -4
L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta --steps 4"
for tree in new old; do
  src=$OLD; [ $tree = new ] && src=$NEW
  echo "== big $tree $(date -u +%T)"
  PYTHONPATH=$src timeout 150 "$PY" $B --methods zerofit-auto $L --timeout 145 --out "$OUT/big_$tree" | head -3
done
rm -f "$OUT"/*/table.md
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/results.json")):
    for r in json.load(open(f))["rows"]:
        if "error" in r:
            print(f.parent.name, r["method"], "FAILED", r["error"][-400:].replace("\n", " | "))
        else:
            print(f"{f.parent.name:14s} {r['method']:20s} s/step={r['s_per_step']:.4f} every={[round(t, 3) for t in r.get('every_step_s', [])]} "
                  f"gpu={r['gpu_peak_gib']:.1f} host={r['host_rss_gib']:.1f} loss={r['losses'][-1]!r} {r.get('planned', '')}")
PYEOF
echo "== done $(date -u +%T)"
