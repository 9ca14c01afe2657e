"""The host optimizer step of offloaded units, overlapped with the next forward.

[Note: overlapped host step]
With optimizer offload, the step of every offloaded flat group runs on the CPU (torch's fused AdamW
over big flat shards). `step()` decides everything that needs all gradients first (global norm,
clipping, fp16 overflow), then hands the groups to one worker thread in forward order and returns.
The worker steps a group, uploads its fp32 master to the device on a copy stream and casts it into
the compute-dtype shard, then marks the group done. The next forward waits, unit by unit, only for
the groups it is about to use - so the CPU step of later units runs while earlier units compute.
Collectives never run on the worker: a group that must be all-gathered after its step (stages 1-2
on several ranks) is gathered by the main thread in the unit's forward pre-hook, in the same order
on every rank. `wait_all()` fences everything (before the next step, checkpoints, inspection).

Each group is stepped by a small optimizer of the script's optimizer class over just that group's
master pieces, sharing the script optimizer's `state` dict and reading its current hyperparameters
(so LR schedulers keep working), which makes the update identical to one big step.

With NVMe offload (`swap`, a `zerofit.engine.offload.nvme.NvmeSwapper`) the worker also swaps each group in
before its step and out after it, while the swapper reads the next groups ahead in submission order.

With optimizer state stored in fewer bits (`narrow`) the worker widens each group's state into fp32 scratch
just before its step and narrows it back right after (see [Note: narrow state on the host] in
zerofit.engine.offload.host_narrow), inside the swap-in / swap-out when the state lives on NVMe.
"""

from __future__ import annotations

import queue
import threading

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.early import current_settings
from zerofit.engine.offload.host_narrow import NarrowHostState
from zerofit.engine.offload.threads import serve
from zerofit.engine.optim import (
    master_pieces,
    step_with_factor,
    sub_optimizer,
    sync_hyperparams,
    unused_pieces,
    without_grads,
)
from zerofit.engine.state_codec import Codec
from zerofit.engine.timing import StepTimes
from zerofit.errors import EngineError


class HostStepper:
    """Runs offloaded groups' optimizer steps on a worker thread; forward waits per group."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], device: torch.device,
                 times: StepTimes | None = None, codec: Codec | None = None):
        """`codec`: how the optimizer state is stored between steps (default fp32, stepped in place)."""
        self.optimizer = optimizer
        self.device = device
        self.times = times or StepTimes()
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._sub = {id(g): sub_optimizer(optimizer, master_pieces(g)) for g in groups}
        self.narrow = NarrowHostState(codec, optimizer, groups) if codec is not None and codec.narrow else None
        """Widens and narrows stored state around each step (None: fp32 state, stepped in place)."""
        self._done: dict[int, threading.Event] = {id(g): threading.Event() for g in groups}
        for e in self._done.values():
            e.set()
        self._events: dict[int, object] = {}
        self._error: BaseException | None = None
        self.swap = None
        """NvmeSwapper when the groups' master and state live in files (set by the engine)."""
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="zerofit-host-step", daemon=True)
        self._thread.start()

    def submit(self, groups: list[FlatGroup], factor=None, *, hyper: list[dict] | None = None,
               settle_grads: bool = False, early: bool = False) -> None:
        """Queue these groups' steps (in this order), gradients times `factor`; forward waits for them.

        `settle_grads`: the worker first waits for the group's gradient download (a step started
        during backward, before the main thread settled it). `early`: a step started during backward
        for groups every parameter of which got a gradient here (so none is left out of it); else
        each group leaves out its parameters no rank gave a gradient (`FlatGroup.unused`, taken now).
        """
        self._raise()
        if isinstance(factor, torch.Tensor):
            factor = factor.to("cpu")  # tiny; the gradients it scales were already waited for
        if self.swap is not None:
            self.swap.schedule(groups)  # start reading the first groups before the worker needs them
        # The settings of this step, taken now: the script's scheduler changes lr on the main thread
        # right after step() returns, while the worker is still stepping later groups.
        hyper = hyper if hyper is not None else current_settings(self.optimizer)
        for g in groups:
            self._done[id(g)].clear()
            self._queue.put((g, factor, hyper, settle_grads, frozenset() if early else g.unused))

    def wait(self, g: FlatGroup) -> None:
        """Block until `g` is stepped and its parameters are on their way to the device (stream-ordered)."""
        done = self._done.get(id(g))
        if done is None:
            return
        if not done.is_set():
            with self.times.measure("wait_host_step"):
                done.wait()
        self._raise()
        event = self._events.pop(id(g), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all(self) -> None:
        with self.times.measure("wait_host_step"):
            for done in self._done.values():
                done.wait()
        self._raise()
        if self.swap is not None:
            self.swap.flush()  # the files hold the stepped values before anyone reads them
        for event in self._events.values():
            torch.cuda.current_stream(self.device).wait_event(event)
        self._events.clear()

    def settle_state(self) -> None:
        """Finish every step and make offloaded masters and optimizer state readable (NVMe: materialised)."""
        self.wait_all()
        if self.swap is not None:
            self.swap.materialize()

    def close(self) -> None:
        """Stop the worker once the queued steps are done (the engine is gone, or the process exits:
        a daemon thread still inside a torch call when the interpreter finalizes aborts the process)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=120)  # bounded: a wedged step must not hang the exit forever
        if self.swap is not None:
            self.swap.close()

    def _raise(self) -> None:
        """Raise the worker's failure on the main thread: an EngineError as itself (its message already says
        what failed and what to do, e.g. a damaged NVMe swap file), anything else wrapped."""
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, EngineError):
                raise err
            raise RuntimeError("the host optimizer step failed") from err

    def _run(self) -> None:
        serve(self._queue, self._run_one)

    def _run_one(self, g: FlatGroup, factor, hyper, settle_grads: bool, unused: frozenset[int]) -> None:
        try:
            if settle_grads:
                g.settle_host_grad()
            self._step(g, factor, hyper, unused)
        except BaseException as e:  # noqa: BLE001 - surfaced on the main thread by wait()
            self._error = e
        finally:
            self._done[id(g)].set()

    def _step(self, g: FlatGroup, factor, hyper: list[dict], unused: frozenset[int]) -> None:
        sub, index = self._sub[id(g)]
        if self.swap is not None:
            with self.times.measure("nvme_wait"):
                self.swap.swap_in(g)
        if sub is not None:
            sync_hyperparams(sub, index, hyper)  # this step's lr & co., as submitted
            with self.times.measure("host_optimizer"):
                if self.narrow is not None:
                    self.narrow.widen(g)
                with without_grads(unused_pieces(g, unused)):
                    step_with_factor(sub, factor)
                if self.narrow is not None:
                    self.narrow.narrow(g)
        g.grad_consumed()
        with self.times.measure("host_publish"):
            event = self._publish(g)
        if self.swap is not None:
            with self.times.measure("nvme_wait"):
                self.swap.swap_out(g, uploaded=event)

    def _publish(self, g: FlatGroup):
        """Start the upload of `g`'s stepped master; returns the event that marks it done (CUDA)."""
        if self.stream is None:
            g.publish_master()
            event = None
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                g.publish_master()
                event = torch.cuda.Event()
                event.record(self.stream)
            self._events[id(g)] = event
        return event

