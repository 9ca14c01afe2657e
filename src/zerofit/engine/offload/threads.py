"""The loop of the offload threads (the host-stepped part's stepper, the GPU-stepped part's issuer)."""

from __future__ import annotations

import contextlib
import queue
import sys
from collections.abc import Callable


def serve(items: queue.Queue, handle: Callable[..., None]) -> None:
    """Call `handle(*item)` for each item taken from `items` until a None arrives. Between items the
    thread holds nothing it was given: groups reach the parameters, whose hooks reach the engine, so a
    held item would keep an engine nobody uses alive."""
    while True:
        item = items.get()
        if item is None:
            return
        with sanitizer_on_this_thread():
            handle(*item)
        del item


def sanitizer_on_this_thread() -> contextlib.AbstractContextManager:
    """torch's CUDA stream sanitizer on this thread too, when the process turned it on (TORCH_CUDA_SANITIZER=1
    or `torch.cuda._sanitizer.enable_cuda_sanitizer()`); otherwise nothing.

    The sanitizer is a dispatch mode, and dispatch modes are per thread: without this, the kernels the
    worker threads launch (the host step's uploads, the GPU-stepped chunks) would go unchecked. It is
    entered per item, so turning the sanitizer off later leaves no thread under it. Never imports the
    sanitizer's module: importing it turns on CUDA tracing for the whole process.
    """
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    if sanitizer is None or not sanitizer.cuda_sanitizer.enabled:
        return contextlib.nullcontext()
    return sanitizer.cuda_sanitizer.dispatch
