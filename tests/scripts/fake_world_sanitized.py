"""Every fake-world case (tests/fake_world.py) on the GPU under torch's CUDA stream sanitizer, then a control.

Run by tests/test_fake_world_gpu.py in a fresh process with TORCH_CUDA_SANITIZER=1, so the sanitizer is on
before the first CUDA call (it knows nothing of earlier allocations) and its process-wide CUDA tracing,
which importing it starts and nothing stops, ends with this process. Prints one JSON line: per world and
case, "ok" with its counts or the error (a race is a CUDASanitizerErrors); and per control, whether the
sanitizer caught the race planted there, so a clean run cannot be a sanitizer that saw nothing.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from fake_world import CASES, fake_world, run_case


def _sanitizer():
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    if sanitizer is None or not sanitizer.cuda_sanitizer.enabled:
        raise SystemExit("run with TORCH_CUDA_SANITIZER=1: the sanitizer is off")
    return sanitizer


def _run_cases(worlds: list[int]) -> dict:
    out = {}
    for world in worlds:
        for case in CASES:
            key = f"world{world}/{case}"
            with tempfile.TemporaryDirectory(prefix="zerofit-fake-nvme-") as nvme_dir:
                try:
                    out[key] = {"ok": True, **run_case(case, world, "cuda", nvme_dir)}
                except Exception as e:  # noqa: BLE001 - reported per case, the loop goes on
                    out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
                                "traceback": traceback.format_exc()[-4000:]}
            print(key, out[key].get("seconds", "failed"), file=sys.stderr, flush=True)
    return out


def _unordered_all_reduce() -> None:
    """A collective on a side stream over a tensor the compute stream just wrote, with no wait_stream."""
    x = torch.ones(1 << 16, device="cuda")
    x.mul_(2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dist.all_reduce(x)
    torch.cuda.synchronize()


def _caught(race, errors) -> bool:
    try:
        race()
    except errors:
        return True
    return False


def _control_main_thread(errors) -> bool:
    with fake_world(0, 2):
        return _caught(_unordered_all_reduce, errors)


def main() -> None:
    sanitizer = _sanitizer()
    worlds = [int(w) for w in sys.argv[1:]] or [2, 8]
    out = {"cases": _run_cases(worlds)}
    errors = sanitizer.CUDASanitizerErrors
    out["controls"] = {"main_thread": _control_main_thread(errors)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
