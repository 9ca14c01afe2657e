# shellcheck shell=bash
# The start the one-device-call scripts share (not run on its own). Each sources it before anything else:
#   . "$(dirname "$0")/preamble.sh" "${1:-}" out/NAME                # benchmarks/NAME_gpu.sh
#   . "$(dirname "$0")/../../benchmarks/preamble.sh" "${1:-}" out/NAME   # tools/gpu/NAME.sh
# Afterwards: OUT_DIR is the output folder (the first argument, else $OUT as the device machine sets it, else the
# second), created and absolute; everything printed from here on is also appended to OUT_DIR/log; the working
# directory is the repository root; PY is the interpreter (PYTHON, else python3); src/ is first on PYTHONPATH (the
# tree's own code, whatever is installed); the Hub, transformers and datasets are offline (the GPU machine has no
# network: a missing file fails at once rather than after retries) and Python's output is unbuffered (the log
# keeps the processes' lines in order).
# use_wheels SITE WHEEL...: installs the wheels (no index, no dependencies) into SITE and puts SITE on PYTHONPATH
# right after src/; nothing when the first WHEEL does not exist (an unmatched glob: no .whl/ was carried).
OUT_DIR="${1:-${OUT:-$2}}"
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)  # before the cd below, so a relative OUT_DIR means the caller's folder
exec > >(tee -a "$OUT_DIR/log") 2>&1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

use_wheels() {
  local site=$1; shift
  [ -e "${1:-}" ] || return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$@" || return
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH#"$PWD/src"}"
}
