"""benchmarks/state_quality.py: the report's arithmetic, and two rows end to end on the CPU (--tiny), so the GPU
run of issue #39's quality check cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import state_quality_report as report  # noqa: E402


def _record(name: str, losses: list[float], reference: str | None, held_out: float) -> dict:
    return {"row": name, "reference": reference, "config": {"window": 2, "gap_from": 3},
            "train_loss": losses, "eval": [[0, 5.0], [len(losses), held_out]]}


def test_smooth_is_a_trailing_mean_and_the_gap_skips_the_warm_up():
    assert report.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    ref = _record("zerofit-fp32", [4.0, 4.0, 2.0, 2.0, 2.0], None, 2.0)
    row = _record("zerofit-8bit", [8.0, 4.0, 2.0, 2.0, 2.02], "zerofit-fp32", 2.0)
    # smoothed: ref [4, 4, 3, 2, 2], row [8, 6, 3, 2, 2.01]; steps >= 3 only: the early 100 % gap is warm-up
    gap, step = report.max_gap(row, ref)
    assert step == 5 and gap == pytest.approx(0.005)


def test_verdicts_compare_8bit_rows_each_with_its_own_fp32_row():
    rows = {"zerofit-fp32": _record("zerofit-fp32", [3.0] * 6, "torch-adamw", 3.0),
            "zerofit-8bit": _record("zerofit-8bit", [3.0] * 5 + [3.09], "zerofit-fp32", 2.9),
            "torch-adamw": _record("torch-adamw", [2.0] * 6, None, 2.0),
            "torchao-8bit": _record("torchao-8bit", [2.0] * 5 + [2.01], "torch-adamw", 2.02)}
    lines = report.verdicts(rows)
    assert "zerofit-8bit within 1% of zerofit-fp32 after warm-up: NO (max gap 1.50% at step 6)" in lines[0]
    # gap 1.50 % vs 0.25 %; held-out -3.3 % (below its fp32 row: no excess) vs +1 %
    assert lines[-1].endswith("worse on max gap")
