"""benchmarks/estimate_check.py end to end on CPU with tiny models, so the GPU validation script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs benchmarks/estimate_check.py end to end

ROOT = Path(__file__).resolve().parents[1]


def test_estimate_check_tiny_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    script = ROOT / "benchmarks" / "estimate_check.py"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--models", "gpt2-tiny",
                           "--settings", "s2-offload", "--steps", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "estimate_check.json").read_text())
    (row,) = data["rows"]
    assert "error" not in row, row.get("error")
    assert row["model"] == "gpt2-tiny" and row["setting"] == "s2-offload"
    assert row["gpu_bytes"] > 0 and row["host_bytes"] > row["gpu_bytes"]  # optimizer state went to the host
    assert row["host_rss_bytes"] > 0 and row["gpu_peak_bytes"] is None  # no allocator peak on CPU
    assert "| gpt2-tiny | s2-offload |" in (tmp_path / "estimate_check.md").read_text()
