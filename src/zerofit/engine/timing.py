"""Where an offloaded step's time goes: cumulative seconds per phase, for benchmarks and tuning.

Counters, not a profiler: each is two `perf_counter` reads around a phase that already blocks or
already runs on the host (the host optimizer step, a wait for it, a wait for gradient downloads), so
they cost nothing measurable and are always on. GPU-side phases (forward, backward, copies) are
timed by the caller with CUDA events; see `benchmarks/engine_step.py`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class StepTimes:
    """Seconds summed since the engine was built; diff two `snapshot()`s to get one step's share."""

    host_optimizer: float = 0.0
    """Worker thread: the optimizer math on host memory (all offloaded groups)."""
    host_publish: float = 0.0
    """Worker thread: issuing the upload of stepped masters (and NVMe swaps); the copies run async."""
    nvme_wait: float = 0.0
    """Worker thread (host stepper or stream issuer): waiting for a group's state to be read from / handed
    to its NVMe file."""
    wait_host_step: float = 0.0
    """Main thread: forward (or a read of the state) blocked until a group's host step finished."""
    wait_grad_download: float = 0.0
    """Main thread: end of backward blocked until the gradient shards reached host memory."""
    stream_issue: float = 0.0
    """Issuing thread: queuing the chunks of GPU-stepped groups on their streams (the work itself runs async)."""
    wait_stream_issue: float = 0.0
    """Main thread: forward (or a read of the state) blocked until the issuing thread had queued a group's
    chunks (with NVMe: read its state from the file first)."""
    host_steps_in_backward: int = 0
    """Groups whose host step started during backward ([Note: updates during backward], offload/early.py)."""
    gpu_steps_in_backward: int = 0
    """GPU-stepped groups issued during backward (the same note)."""

    def snapshot(self) -> dict[str, float]:
        return asdict(self)

    @contextmanager
    def measure(self, field: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
