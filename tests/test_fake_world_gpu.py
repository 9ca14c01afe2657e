"""Fake worlds of 2 and 8 ranks on one GPU under torch's CUDA stream sanitizer: no race, no crash (#30).

The engine at world > 1 on CUDA runs its collectives on a side stream, its host steps and GPU-stepped
chunks on worker threads with their own streams; NCCL gives a collective no stream of its own (torch
>= 2.8 launches it on the caller's current stream), so zerofit's waits and lifetimes are all that order
it. The sanitizer checks every kernel the main thread launches (the compute, the collectives on their
side stream, stage 3's gathers, the waits on the offload threads' events) against the streams'
recorded waits. Not the offload threads' own kernels: entered on those threads too (torch 2.11), the
sanitizer reported races in 10 of 14 offloaded runs, at random, some between two kernels of the main
thread that wait_event orders, and none in 28 runs with the main thread alone: its tracking is shared
by the threads without a lock. The fake group's collectives write nothing, so this checks order and
lifetimes, never values (see tests/fake_world.py).

One subprocess runs every case (tests/scripts/fake_world_sanitized.py): the sanitizer must be on before
the first CUDA call, and importing it starts CUDA tracing for the whole process, which nothing stops.
Its control plants a race on the main thread and must see it caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_world import CASES, STEPS

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TESTS = Path(__file__).parent
SCRIPT = TESTS / "scripts" / "fake_world_sanitized.py"


@pytest.fixture(scope="module")
def sanitized():
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), "2", "8"], env=env, capture_output=True, text=True,
                              timeout=540)
    except subprocess.TimeoutExpired as e:  # each case prints its name when done: the last one shows where
        pytest.fail(f"the sanitized run did not finish in {e.timeout:.0f} s:\n{_text(e.stderr)[-6000:]}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    print(proc.stderr[-3000:])  # each case's time, shown with -s
    return json.loads(proc.stdout.strip().splitlines()[-1])


@requires_cuda
def test_the_sanitizer_catches_a_planted_race_on_the_main_thread(sanitized):
    assert sanitized["controls"] == {"main_thread": True}


@requires_cuda
@pytest.mark.parametrize("world", [2, 8])
def test_every_stage_and_offload_runs_race_free_in_a_fake_world(sanitized, world):
    failed = {k: v["error"] + "\n" + v["traceback"] for k, v in sanitized["cases"].items()
              if k.startswith(f"world{world}/") and not v["ok"]}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
    for case in CASES:
        got = sanitized["cases"][f"world{world}/{case}"]
        assert got["calls"] > 0, case
        if case.precision != "fp16":  # an fp16 step may be skipped: the fake collectives leave garbage
            assert got["stepped"] == STEPS, (case, got)


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
