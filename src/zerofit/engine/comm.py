"""The collectives the engine uses, issued off the compute stream and labelled for the profiler.

Every call returns a `Pending`; its `wait()` makes the caller's stream (GPU) or thread (CPU) wait for
the result and runs the follow-up work given as `then`. With one rank every call is a no-op apart from
`then`, so the same engine code runs unchanged on one rank and on many.

[Note: streams and lifetimes]
On CUDA a collective runs on `Collectives.stream`, a high-priority side stream that first waits for
the compute stream (so it reads finished data); `then` runs on the same side stream right after it.
`wait()` makes the current stream wait for the event recorded after `then`. Tensors the collective
touches are held by the `Pending` until `wait()` returns: after that the compute stream is ordered
after the collective, so the caching allocator may safely reuse their memory. No `record_stream`.
"The compute stream" is always the current stream *of the engine's GPU*, named explicitly: the
current device may be another one (GPU 0 when the script created the process group without
selecting a device), and its stream orders nothing the engine does (#30).
On CPU (gloo) the collective is async on gloo's own thread; `wait()` blocks on it, then runs `then`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zerofit.distributed import failures

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""Every rank's equal slice into one flat tensor: torch's newer name where it has it (the older one warns
FutureWarning: deprecated there), else the older one. Every flat all-gather of zerofit goes through it."""
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight (or a finished no-op), plus the work to run once it is done."""

    __slots__ = ("_work", "_event", "_device", "_then", "_keep", "done", "label", "rank")

    def __init__(self, work=None, event=None, then: Callable[[], None] | None = None, keep=(),
                 label: str = "", rank: int = 0, device: torch.device | None = None):
        self._work, self._event, self._then, self._keep = work, event, then, keep
        self._device = device
        """The event's device: its current stream waits (never the current device's: see #30)."""
        self.done = False
        self.label, self.rank = label, rank

    def wait(self) -> None:
        if self.done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            if self._work is not None:
                with failures.named(self.label, self.rank, wait=True):
                    self._work.wait()
            if self._then is not None:
                self._then()
        self._work = self._event = self._then = None
        self._keep = ()
        self.done = True


class Collectives:
    """Collectives over one process group, run on a side stream on CUDA and asynchronously on CPU."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 grad_dtype: torch.dtype = torch.float32):
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.device = device
        self.grad_dtype = grad_dtype
        """The dtype gradient reductions travel in (`precision.communication_data_type`); the units cast to it
        (see [Note: gradients on the wire] in zerofit.engine.unit)."""
        self.calls = 0
        """Collectives issued so far (world > 1 only): lets tests prove a micro-step stayed silent."""
        self.trace: list[tuple[str, tuple[int, ...], tuple[torch.dtype, ...]]] | None = None
        """Set to a list to record every collective issued (world > 1): its label, and the sizes and dtypes of
        the tensors it touches. Tests compare the ranks' traces (see [Note: one collective order])."""
        # High priority so that gathers needed by the next layer are not queued behind compute.
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None

    def _issue(self, label: str, run: Callable[[bool], object] | None, then, keep) -> Pending:
        """Run `run(async_op)` then `then()` off the compute stream; `run` None: nothing to communicate."""
        if run is None and then is None:
            return _finished()
        if self.world > 1:
            self._count(label, keep)
        with record_function(f"zerofit::{label}"):
            if self.stream is None:
                with failures.named(label, self.rank):
                    work = run(True) if run is not None else None
                if work is None and then is not None:
                    then()
                    return _finished()
                return Pending(work=work, then=then, keep=keep, label=label, rank=self.rank)
            device = self.stream.device  # the engine's GPU, whichever is current (a script may not set it)
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                if run is not None:
                    with failures.named(label, self.rank):
                        run(False)
                if then is not None:
                    then()
                event = torch.cuda.Event()
                event.record(self.stream)
            return Pending(event=event, keep=keep, device=device)

    def _count(self, label: str, tensors) -> None:
        self.calls += 1
        if self.trace is not None:
            self.trace.append((label, tuple(t.numel() for t in tensors), tuple(t.dtype for t in tensors)))

    def all_gather(self, out_full: torch.Tensor, in_shard: torch.Tensor, label: str,
                   then: Callable[[], None] | None = None) -> Pending:
        """Fill `out_full` with every rank's `in_shard` in rank order (in place if `in_shard` is its slice).

        `in_shard` may live in host memory (offloaded parameters): it is uploaded on the way.
        """
        if self.world == 1:
            same = out_full.data_ptr() == in_shard.data_ptr()
            run = None if same else (lambda a: _copy(out_full, in_shard))
            return self._issue(f"upload:{label}", run, then, (out_full, in_shard))

        def run(a):
            src = in_shard.to(out_full.device, non_blocking=True)
            return all_gather_flat(out_full, src, group=self.group, async_op=a)
        return self._issue(f"all_gather:{label}", run, then, (out_full, in_shard))

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor, label: str,
                       then: Callable[[], None] | None = None) -> Pending:
        """Sum `in_full` over ranks and leave this rank's shard of the sum in `out_shard`."""
        if self.world == 1:
            same = out_shard.data_ptr() == in_full.data_ptr()
            run = None if same else (lambda a: _copy(out_shard, in_full))
            return self._issue(f"copy:{label}", run, then, (out_shard, in_full))
        return self._issue(f"reduce_scatter:{label}",
                           lambda a: _reduce_scatter(out_shard, in_full, group=self.group, async_op=a),
                           then, (out_shard, in_full))

    def all_reduce(self, tensor: torch.Tensor, label: str, then: Callable[[], None] | None = None) -> Pending:
        """Sum `tensor` over ranks in place."""
        if self.world == 1:
            return self._issue(f"all_reduce:{label}", None, then, (tensor,))
        return self._issue(f"all_reduce:{label}",
                           lambda a: dist.all_reduce(tensor, group=self.group, async_op=a),
                           then, (tensor,))

    def all_reduce_now(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Sum `tensor` over ranks in place on the current stream (for small scalars on the step path)."""
        if self.world > 1:
            self._count(f"all_reduce:{label}", (tensor,))
            with record_function(f"zerofit::all_reduce:{label}"), failures.named(f"all_reduce:{label}", self.rank):
                dist.all_reduce(tensor, group=self.group)
        return tensor


    def max_now(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """The elementwise maximum of `tensor` over ranks, in place on the current stream (small tensors)."""
        if self.world > 1:
            self._count(f"all_reduce_max:{label}", (tensor,))
            with record_function(f"zerofit::all_reduce_max:{label}"), \
                    failures.named(f"all_reduce_max:{label}", self.rank):
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def broadcast_now(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place on the current stream."""
        if self.world > 1:
            self._count(f"broadcast:{label}", (tensor,))
            with record_function(f"zerofit::broadcast:{label}"), failures.named(f"broadcast:{label}", self.rank):
                dist.broadcast(tensor, dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                               group=self.group)
        return tensor


def _finished() -> Pending:
    p = Pending()
    p.done = True
    return p


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class InFlight:
    """Reductions in flight, at most `limit`: launching another first waits for the oldest (which
    bounds the transient gradient memory backward holds)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pending: deque[Pending] = deque()

    def launch(self, pendings: list[Pending]) -> None:
        self._pending.extend(pendings)
        while len(self._pending) > self.limit:
            self._pending.popleft().wait()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().wait()
