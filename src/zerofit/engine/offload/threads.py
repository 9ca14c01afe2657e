"""The loop of the offload threads (the host-stepped part's stepper, the GPU-stepped part's issuer)."""

from __future__ import annotations

import queue
from collections.abc import Callable


def serve(items: queue.Queue, handle: Callable[..., None]) -> None:
    """Call `handle(*item)` for each item taken from `items` until a None arrives. Between items the
    thread holds nothing it was given: groups reach the parameters, whose hooks reach the engine, so a
    held item would keep an engine nobody uses alive."""
    while True:
        item = items.get()
        if item is None:
            return
        handle(*item)
        del item

