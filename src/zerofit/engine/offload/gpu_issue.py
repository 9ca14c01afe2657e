"""`IssueThread`: the worker thread that issues GPU-stepped groups' work, so the main thread never waits for it.

[Note: issuing off the main thread]
`GpuStep.step()` decides everything that needs all gradients (the factor, the settings of this
step), records the event after which the gradients are final, and hands the groups to this thread in
forward order. For each group the thread runs the step mode's `issue(g)`: swap the group's state in
from its NVMe file (a blocking read), queue its chunk uploads, steps and downloads on the three side
streams, record the group's done event, and hand the state back to the swapper. Then it marks the
group issued. The main thread goes on to the next forward and, per unit, waits only until that
unit's groups are issued (a `threading.Event`), then makes its stream wait for their done events.
So neither a disk read nor the thousands of kernel launches of a big model block the main thread.

Streams and events are explicit in every call, and the current stream is thread-local, so work
launched here orders exactly as it would from the main thread. Collectives never run here.

An exception in `issue` is kept, the rest of that step's groups are marked issued without being
issued (no wait hangs), and the next `wait`/`wait_all` raises it on the main thread, once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.threads import serve
from zerofit.errors import EngineError


class IssueThread:
    """Runs `issue(g)` for submitted groups, in order, on one daemon thread; the main thread waits per group."""

    def __init__(self, groups: list[FlatGroup], device: torch.device):
        self.device = device
        self._issued: dict[int, threading.Event] = {id(g): threading.Event() for g in groups}
        for e in self._issued.values():
            e.set()
        self._error: BaseException | None = None
        self._calls, self._calls_lock, self._no_calls = 0, threading.Lock(), threading.Event()
        """Work queued by `call` and not yet run (`wait_all` waits for it too)."""
        self._no_calls.set()
        self._queue: queue.Queue = queue.Queue()
        # Daemon: a thread blocked in a read that a failed write never frees must not hang the exit.
        self._thread = threading.Thread(target=self._run, name="zerofit-stream-issue", daemon=True)
        self._thread.start()

    def submit(self, groups: list[FlatGroup], issue: Callable[[FlatGroup], None]) -> None:
        """Queue `issue(g)` for each of `groups`, in this order."""
        self.raise_error()
        for g in groups:
            self._issued[id(g)].clear()
        self._queue.put((groups, issue))

    def call(self, work: Callable[[], None]) -> None:
        """Run `work()` on the thread after what was queued before it (benchmarks/engine_step.py profiles the thread
        this way); what it raises is raised by the next `wait`/`wait_all`, as an issue's failure is."""
        with self._calls_lock:
            self._calls += 1
            self._no_calls.clear()
        self._queue.put((None, work))

    def wait(self, g: FlatGroup) -> None:
        """Block until `g`'s work is issued; raise what the thread raised since the last wait."""
        self._issued[id(g)].wait()
        self.raise_error()

    def wait_all(self) -> None:
        for done in self._issued.values():
            done.wait()
        self._no_calls.wait()
        self.raise_error()

    def close(self) -> None:
        """Stop the thread once the queued work is issued (the step mode is gone, or the process exits)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=120)  # bounded: a wedged read must not hang the exit forever

    def raise_error(self) -> None:
        """Raise the thread's failure here: an EngineError as itself (its message already names what failed and
        the fix, e.g. a damaged NVMe swap file), anything else wrapped in one."""
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, EngineError):
                raise err
            raise EngineError(f"the GPU-stepped optimizer step failed on its issuing thread "
                              f"({type(err).__name__}: {err}); this step's update is incomplete: see the cause "
                              "above, fix it and resume from the last checkpoint") from err

    def _run(self) -> None:
        serve(self._queue, self._run_one)

    def _run_one(self, groups: list[FlatGroup] | None, issue: Callable) -> None:
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        if groups is None:
            try:
                with device:
                    issue()
            except BaseException as e:  # noqa: BLE001 - surfaced on the main thread by wait()
                self._error = e
            with self._calls_lock:
                self._calls -= 1
                if not self._calls:
                    self._no_calls.set()
            return
        with torch.no_grad(), device:
            failed = False
            for g in groups:
                try:
                    if not failed:  # after a failure the step is lost: only release the waits
                        issue(g)
                except BaseException as e:  # noqa: BLE001 - surfaced on the main thread by wait()
                    failed, self._error = True, e
                finally:
                    self._issued[id(g)].set()


def interleaved(groups: list[FlatGroup], resident: set[int]) -> list[FlatGroup]:
    """`groups` (in forward order) with those in `resident` (ids) and the others merged in proportion to their
    elements, each kind in its own order: a group comes where the middle of its elements falls in its kind's total
    (see [Note: resident chunks] in zerofit.engine.offload.gpu)."""
    totals = {True: 0, False: 0}
    for g in groups:
        totals[id(g) in resident] += g.master.numel()
    done = {True: 0, False: 0}
    keyed = []
    for i, g in enumerate(groups):
        kind, n = id(g) in resident, g.master.numel()
        keyed.append(((done[kind] + n / 2) / max(1, totals[kind]), not kind, i, g))
        done[kind] += n
    return [g for *_, g in sorted(keyed, key=lambda k: k[:3])]
