"""ruff, the lint CI runs (`./run.sh lint`), reads every Python file of the repository.

Its default excludes skip folders with common build names (`dist`, `build`, `venv`, ...) wherever they
are: a package of ours with such a name was silently never linted (zerofit.dist, now zerofit.distributed).
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "tools", "benchmarks", "examples")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff comes with the dev extra")
def test_ruff_lists_every_python_file():
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    linted = {Path(p).resolve() for p in shown if p.endswith(".py")}
    ours = {p.resolve() for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts}
    assert ours and not ours - linted, f"ruff skips: {sorted(str(p.relative_to(ROOT)) for p in ours - linted)}"
