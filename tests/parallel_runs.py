"""Launches a test module reads, started two at a time (shared by the modules whose tests read end-to-end runs)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def two_at_a_time(keys: Iterable[Hashable], run: Callable[[Any], Any],
                  kept: tuple[type[BaseException], ...] = ()) -> Callable[[Any], Any]:
    """Start `run(key)` for every key in `keys` (in their order, each once), two at a time, and wait for them: a
    launch alone leaves a core of a 2-core machine idle much of the time, two keep both busy. Returns `get(key)`:
    the key's result, run now if it was not among `keys`. A run that raised one of `kept` raises it again in each
    `get` of its key (it fails only the tests that read it); anything else raises here."""
    done: dict = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run, key) for key in dict.fromkeys(keys)}
    for key, future in futures.items():
        try:
            done[key] = future.result()
        except kept as e:
            done[key] = e

    def get(key):
        if key not in done:
            done[key] = run(key)
        if isinstance(done[key], BaseException):
            raise done[key]
        return done[key]

    return get
