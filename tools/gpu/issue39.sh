#!/usr/bin/env bash
# Issue #39's GPU checks in one device call. Log: $OUT/log.
#   bash tools/gpu/issue39.sh OUT [tests|xl|early|cycle|prof|bigprof|bigtrace|big|ab]...   (default: tests xl)
# tests:   the engine's GPU tests (fp32 state bit for bit as before; bf16/8-bit state the same in every home)
# xl:      the codec's speed, then GPT-2 XL 16x128 bf16: ZeRO-2 + GPU-stepped optimizer offload and ZeRO-3 + full
#          offload with fp32, bf16 and 8-bit optimizer state; no offload and plain PyTorch beside
# early:   GPT-2 XL 8-bit without clipping (the step streams during backward: ZeRO-2 and ZeRO-3 offload) beside
#          ZeRO-2 offload with clipping 1.0 (it cannot), fp32 state and no offload without clipping
# cycle:   GPT-2 XL ZeRO-2 8-bit without clipping: each step's phases, and a Chrome trace of three more steps
# bigtrace: the 9.2 B 8-bit row with Chrome traces of its first three steps (step 2 against the steady step) and of
#          three steady ones (where the stream's wall time goes against its copies)
# bigprof: the 9.2 B 8-bit row once more, with the host ops of two steps recorded (where its issuing thread's ~7 ms
#          per chunk go: session 15 saw 1.08 s of issuing a step against 0.46 s of copies)
# big:     the 9.2 B Llama (13 B shape, 28 layers) 8x512 under stage: auto, fp32 and 8-bit state (every step timed:
#          step 2 against the steady step)
# ab:      OLD_SRC's tree against this one, same call: the 9.2 B 8-bit row and GPT-2 XL ZeRO-2 offload 8-bit
# ab3:     OLD_SRC's tree against this one, same call: GPT-2 XL ZeRO-3 full offload and ZeRO-2 offload, 8-bit
# abissue: OLD_SRC's tree against this one: GPT-2 XL ZeRO-2 offload 8-bit with Python's profile of the issuing
#          thread (where a tree's stream issue spends its time; e.g. OLD_SRC from `git archive e27021c src`, the
#          bf16 block scales that made this row slower in session 20)
# spread:  GPT-2 XL ZeRO-2 offload 8-bit in ROUNDS (3) fresh processes: the spread between runs of one tree on one
#          box (session 21: 0.205-0.307 s, with the issuing thread's time); with OLD_SRC set, that tree takes turns;
#          TRACE=1: each process also writes a Chrome trace of 3 more steps (all in traces.tar: a fast and a slow
#          process side by side, the copies against the issuing)
# peers:   DeepSpeed's GPT-2 XL ZeRO-2 + offload and ZeRO-3 + full offload (its wheels carried in .whl/) beside
#          zerofit's with fp32 and 8-bit state, all in this call (the same-call ratios)
set -uo pipefail
. "$(dirname "$0")/../../benchmarks/preamble.sh" "${1:-}" out/issue39
shift || true
WHAT="${*:-tests xl}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
B="$PY benchmarks/engine_step.py --steps 6"
tree_src() { if [ "$1" = old ]; then (cd "$OLD_SRC" && pwd); else echo "$PWD/src"; fi; }  # the A/B modes' two trees
for what in $WHAT; do
  echo "== $what ($(date -u +%T))"
  case "$what" in
    tests)
      timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_engine_gpu.py tests/test_engine_state_dtype_gpu.py tests/test_shard_file.py tests/test_engine_handover.py \
        2>&1 | tail -15 ;;
    xl)
      "$PY" benchmarks/codec_speed.py
      for st in fp32 8bit bf16; do
        rows="zerofit-s2-offload zerofit-s3-offload"; [ "$st" = bf16 ] && rows="zerofit-s2-offload"
        timeout 400 $B --methods $rows --optimizer-state "$st" --timeout 180 --out "$OUT_DIR/xl_$st" | head -4
      done
      [ -n "${NO_OFFLOAD:-}" ] && timeout 300 $B --methods zerofit-s2 torch --timeout 140 --out "$OUT_DIR/xl_no_offload" ;;
    prof)
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --profile-cpu --timeout 180 --out "$OUT_DIR/p_8bit" | head -3
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state fp32 --profile-cpu --timeout 180 --out "$OUT_DIR/p_fp32" | head -3
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --stream-chunk 67108864 --timeout 180 \
        --out "$OUT_DIR/p_8bit_c64" | head -3
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --switch-interval 0.0005 --timeout 180 \
        --out "$OUT_DIR/p_8bit_sw" | head -3
      "$PY" - "$OUT_DIR" <<'PYEOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("p_*/results.json")):
    for r in json.load(open(f))["rows"]:
        print("==", f.parent.name, {k: round(v, 3) for k, v in r.get("breakdown_s", {}).items()})
        print("\n".join(r.get("cpu_profile", [])))
PYEOF
      ;;
    early)
      timeout 300 $B --methods zerofit-s2-offload zerofit-s3-offload --optimizer-state 8bit --clip 0 --timeout 140 \
        --out "$OUT_DIR/early_8bit" | head -4
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --timeout 140 --out "$OUT_DIR/clip_8bit" | head -3
      timeout 200 $B --methods zerofit-s2-offload --optimizer-state fp32 --clip 0 --timeout 140 \
        --out "$OUT_DIR/early_fp32" | head -3
      timeout 200 $B --methods zerofit-s2 --clip 0 --timeout 140 --out "$OUT_DIR/noclip_no_offload" | head -3 ;;
    cycle)  # GPT-2 XL ZeRO-2 8-bit without clipping, 9 steps: every step's phases and a trace of 3 more
      timeout 250 $B --methods zerofit-s2-offload --optimizer-state 8bit --clip 0 --steps 9 --trace "$OUT_DIR/trace" \
        --timeout 240 --out "$OUT_DIR/cycle_8bit" | head -3
      "$PY" - "$OUT_DIR/cycle_8bit/results.json" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for i, p in enumerate(r.get("phases_every_step", [])):
        print(i + 2, " ".join(f"{k}={v:.3f}" for k, v in p.items()))
PYEOF
      ;;
    bigtrace)  # the 9.2 B 8-bit row with traces of its first three steps and of three steady ones (CLIP as in big)
      L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta"
      timeout 290 $B --methods zerofit-auto $L --steps 4 --optimizer-state 8bit --clip "${CLIP:-1.0}" \
        --trace "$OUT_DIR/trace" --trace-first --timeout 280 --out "$OUT_DIR/bigtrace" | head -3 ;;
    bigissue)  # the 9.2 B 8-bit row with Python's profile of the issuing thread: the first step's stream, a steady one
      L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta"
      timeout 290 $B --methods zerofit-auto $L --steps 4 --optimizer-state 8bit --clip "${CLIP:-1.0}" --profile-issue \
        --timeout 280 --out "$OUT_DIR/bigissue" | head -3
      "$PY" - "$OUT_DIR/bigissue/results.json" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for name, lines in r.get("issue_profile", {}).items():
        print("== issuing thread:", name)
        print("\n".join(lines))
PYEOF
      ;;
    bigprof)
      L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta"
      timeout 290 $B --methods zerofit-auto $L --steps 4 --optimizer-state 8bit --clip "${CLIP:-1.0}" --profile-cpu \
        --timeout 280 --out "$OUT_DIR/bigprof" | head -3
      "$PY" - "$OUT_DIR/bigprof/results.json" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print("\n".join(r.get("cpu_profile", [])))
PYEOF
      ;;
    ab)  # OLD_SRC (another tree's src/, e.g. from `git archive`) against this one: the 9.2 B 8-bit row (CLIP as in
         # big) and GPT-2 XL ZeRO-2 offload 8-bit, each tree in its own process, the new one first
      L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta"
      for tree in new old; do
        src=$(tree_src "$tree")
        PYTHONPATH=$src timeout 200 $B --methods zerofit-auto $L --steps 5 --optimizer-state 8bit --clip "${CLIP:-1.0}" \
          --timeout 190 --out "$OUT_DIR/ab_big_$tree" | head -3
        PYTHONPATH=$src timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --timeout 140 \
          --out "$OUT_DIR/ab_xl_$tree" | head -3
      done ;;
    abissue)  # OLD_SRC against this tree, GPT-2 XL ZeRO-2 offload 8-bit, the issuing thread profiled, new first
      for tree in new old; do
        src=$(tree_src "$tree")
        PYTHONPATH=$src timeout 200 $B --methods zerofit-s2-offload --optimizer-state 8bit --profile-issue \
          --timeout 140 --out "$OUT_DIR/abissue_$tree" | head -3
        "$PY" - "$OUT_DIR/abissue_$tree/results.json" "$tree" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for name, lines in r.get("issue_profile", {}).items():
        print(f"== {sys.argv[2]} tree, issuing thread: {name}")
        print("\n".join(lines[:30]))
PYEOF
      done ;;
    spread)
      for i in $(seq "${ROUNDS:-3}"); do
        for tree in new ${OLD_SRC:+old}; do
          src=$(tree_src "$tree")
          trace=(); [ -n "${TRACE:-}" ] && mkdir -p "$OUT_DIR/tr" && trace=(--trace "$OUT_DIR/tr/spread_${tree}_$i")
          PYTHONPATH=$src timeout 120 $B --methods zerofit-s2-offload --optimizer-state 8bit --timeout 100 \
            "${trace[@]}" --out "$OUT_DIR/spread_${tree}_$i" | tail -1
        done
      done
      [ -d "$OUT_DIR/tr" ] && tar -cf "$OUT_DIR/traces.tar" -C "$OUT_DIR" tr && rm -rf "$OUT_DIR/tr" ;;
    peers)  # needs .whl/ with ../shared/wheels' DeepSpeed and its dependencies (carry it)
      use_wheels /tmp/site .whl/*.whl
      timeout 420 $B --methods deepspeed-s2-offload deepspeed-s3-offload --timeout 300 --out "$OUT_DIR/peers_ds" | head -4
      for st in 8bit fp32; do
        timeout 300 $B --methods zerofit-s2-offload zerofit-s3-offload --optimizer-state "$st" --timeout 140 \
          --out "$OUT_DIR/peers_zf_$st" | head -4
      done ;;
    ab3)  # OLD_SRC against this tree, each in its own process, the new one first
      for tree in new old; do
        src=$(tree_src "$tree")
        PYTHONPATH=$src timeout 250 $B --methods zerofit-s3-offload zerofit-s2-offload --optimizer-state 8bit \
          --timeout 120 --out "$OUT_DIR/ab3_xl_$tree" | head -4
      done ;;
    big)
      L="--model llama --n_embd 5120 --n_layer 28 --n_head 40 --intermediate 13824 --batch 8 --seq 512 --meta"
      for st in ${STATES:-8bit fp32}; do
        timeout 290 $B --methods zerofit-auto $L --steps 4 --optimizer-state "$st" --clip "${CLIP:-1.0}" --timeout 280 \
          --out "$OUT_DIR/big_$st" | head -3
      done ;;
  esac
done
"$PY" - "$OUT_DIR" <<'PYEOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/results.json")):
    for r in json.load(open(f))["rows"]:
        if "error" in r:
            print(f.parent.name, r["method"], "FAILED", r["error"][-300:].replace("\n", " | "))
        else:
            print(f"{f.parent.name:16s} {r['method']:22s} state={r.get('optimizer_state')} s/step={r['s_per_step']:.4f} "
                  f"every={[round(t, 3) for t in r.get('every_step_s', [])]} gpu={r['gpu_peak_gib']:.1f} "
                  f"host={r['host_rss_gib']:.1f} loss={r['losses'][-1]:.4f} planned={r.get('planned', '-')} "
                  f"compiled={r.get('kernels_compiled_every_step', '-')} kept={r.get('units_kept', '-')} "
                  + " ".join(f"{k}={r.get('breakdown_s', {}).get(k, 0):.3f}"
                             for k in ("stream_issue", "copy_to_gpu", "copy_to_host")))
PYEOF
rm -f "$OUT_DIR"/*/table.md  # the device returns 8 files: the results and traces
echo "== done ($(date -u +%T))"
