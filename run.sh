#!/usr/bin/env bash
# The README's two commands, set-up included:
#   ./run.sh demo [ARGS...]    the main job: a tiny model trained by 2 CPU processes on shipped text
#   ./run.sh test [ARGS...]    the test suite (CPU only): python -m pytest -x -q
# and, for contributors and CI:
#   ./run.sh lint [ARGS...]    ruff over every Python file of the repository (settings in pyproject.toml)
# On first use it creates a virtual environment ($ZEROFIT_VENV, default .venv) with torch, zerofit
# (editable, with its dev, examples, bench, trainer and trackers extras); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ZEROFIT_VENV:-.venv}"
# An absolute path: PATH gets $VENV/bin, and a relative entry there leaves sys.executable relative, which
# breaks every test that starts `sys.executable` from another directory.
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/zerofit" ]; then
  # pip runs quietly (-q) for minutes: say what is happening, on stderr, so stdout stays the job's.
  say() { echo "run.sh: $*" >&2; }
  say "creating $VENV with torch $TORCH_VERSION and zerofit (first run only, a few minutes)..."
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)
  # torch first and pinned, so the range in pyproject (torch>=2.4) pulls no other build.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    say "installing torch $TORCH_VERSION..."
    "${pip[@]}" install "torch==$TORCH_VERSION"
  fi
  # Triton beside a CPU torch (a CUDA torch brings its own): tests/test_fused_kernels.py runs the fused CUDA
  # kernels in Triton's interpreter on the CPU. Best effort: without a wheel for this Python that test is skipped.
  if ! "$VENV/bin/python" -c "import triton" 2>/dev/null && [ "$(uname -sm)" = "Linux x86_64" ]; then
    say "installing triton (the fused kernels' CPU check)..."
    "${pip[@]}" install "triton==3.5.0" || say "no triton wheel for this Python: tests/test_fused_kernels.py will skip"
  fi
  say "installing zerofit (editable) with its dev, examples, bench, trainer and trackers extras..."
  # examples: transformers, datasets, sacrebleu, scikit-learn; bench: matplotlib; trainer: accelerate, peft, trl;
  # trackers: wandb, mlflow-skinny, comet_ml, aim, clearml, dvclive
  "${pip[@]}" install -e '.[dev,examples,bench,trainer,trackers]'
  say "$VENV is ready; later runs reuse it"
fi

# Nothing reaches for the model hub: tests and recipes build tiny models from configs.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PATH="$VENV/bin:$PATH"

case "${1:-}" in
  demo) shift; exec zerofit demo "$@" ;;
  test) shift; exec python -m pytest -x -q "$@" ;;
  lint) shift; exec ruff check . "$@" ;;
  *) echo "usage: ./run.sh demo [ARGS...] | ./run.sh test [PYTEST ARGS...] | ./run.sh lint [RUFF ARGS...]" >&2; exit 2 ;;
esac
