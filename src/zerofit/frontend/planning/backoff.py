"""Out-of-memory back-off: a CUDA OOM in a micro-step halves the micro-batch and doubles accumulation.

An unchanged Accelerate-style loop keeps running:

    for batch in loader:                          # a prepared ShardedDataLoader
        with accelerator.accumulate(model):       # <- catches the OOM (`OomBackoff.guard`)
            loss = model(**batch).loss
            accelerator.backward(loss)            # <- ranks agree here (`OomBackoff.before_backward`)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

[Note: back-off keeps the run's numerics]
On `torch.OutOfMemoryError` inside the block, the partial accumulation window is thrown away
(`engine.discard_window`), memory is freed (the failed forward's frames cleared, gc, empty_cache), the
prepared loader re-yields the window's batches - the ones already seen and the current one - cut in
halves (`BatchSplitter`), and accumulation is doubled in the accumulation window the loader's
`GradientState` shares with the engine.
The optimizer then steps once per original global batch on the same samples, and every
micro-step's loss is divided by the doubled count, so the mean of the halves' mean losses is the
mean of the batch's: the update is the same up to summation order (exact for an even micro-batch
and a per-sample mean loss; a loss averaged over tokens weights the halves by their token counts).
Schedulers advance with real optimizer steps only, so they are unaffected.

[Note: back-off on several ranks]
A rank-local OOM must not let the other ranks run into a collective it will never join. Every
micro-step therefore has one agreement point - an all-reduce of "I hit an OOM" - which a healthy
rank reaches at the start of `accelerator.backward` and a failing rank in `guard`; if any rank
failed, every rank backs off together (healthy ranks leave the block through `PeerOutOfMemory`).
That is safe only while nothing collective ran between the start of the micro-step and that point:
- recoverable: OOM in forward under stages 0-2 without optimizer offload (forward is silent), and
  anywhere before the optimizer step on one rank;
- not recoverable, with an error saying so: OOM in backward or the optimizer step on several ranks
  (reductions are mid-sequence), OOM in forward under stage 3 or optimizer offload on several ranks
  (parameter gathers run in forward), and OOM in the optimizer step anywhere (masters may be half
  updated) - including an OOM late in backward once offloaded groups began their host step early
  (`engine.update_started`).
The agreement costs one tiny all-reduce per micro-step, only with several ranks and a silent forward,
and it is blocking: the host waits for forward to finish on the device before it launches backward.
A run that would rather end on an out-of-memory error than pay that sets `batch.oom_backoff: false`
(zerofit YAML): `guard` then only yields, no window is kept, and no micro-step agrees on anything.
Nothing is less safe than a run without back-off: the failing rank raises the OOM and exits, and the
launcher stops its peers (their next collective fails under gloo; under NCCL the launcher ends them, or at
worst the watchdog does after `launch.process_group_timeout`), as under plain DDP.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofit.distributed.failures import named
from zerofit.errors import EngineError

MAX_BACKOFFS = 4
"""Halvings allowed in one run (the micro-batch can shrink 16-fold) before the error."""


def discard_partial_step(engine: Any) -> None:
    """Forget a failed micro-step's partial window and free what it held (gathered units, gradients, cache)."""
    if engine is not None:
        engine.discard_window()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this micro-step: leave the block so every rank backs off."""


def split_batch(batch: Any, pieces: int) -> list[Any]:
    """`batch` cut into `pieces` along its first dimension (tensors, and lists as long as the batch)."""
    size = batch_size_of(batch)
    if size is None:
        raise EngineError(f"the out-of-memory back-off cuts batches along their first dimension and found no "
                          f"tensor in this {type(batch).__name__}: "
                          "yield tensors (or dicts of them) from the DataLoader")
    bounds = [round(i * size / pieces) for i in range(pieces + 1)]

    def cut(x: Any, i: int) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size:
            return x[bounds[i]:bounds[i + 1]]
        if isinstance(x, Mapping):
            out = {k: cut(v, i) for k, v in x.items()}
            try:
                return type(x)(out)
            except TypeError:
                return out
        if isinstance(x, (list, tuple)):
            if len(x) == size and not any(isinstance(v, torch.Tensor) for v in x):
                return type(x)(x[bounds[i]:bounds[i + 1]])
            items = [cut(v, i) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    return [cut(batch, i) for i in range(pieces)]


def batch_size_of(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        found = batch_size_of(v)
        if found is not None:
            return found
    return None


class BatchSplitter:
    """One prepared loader's pieces: every batch in `factor` pieces, and the window replayed on demand."""

    def __init__(self):
        self.factor = 1
        self.window: list[Any] = []
        """Batches of the accumulation window in progress (to replay it after a back-off)."""
        self.current: Any = None
        """The batch being delivered."""
        self.recording = False
        """Set by the first `accumulate()` block over this loader: only then do windows close (and empty)."""
        self._restart = False

    def deliver(self, batch: Any, *, last: bool, loader: Any) -> Iterator[Any]:
        """Yield `batch`'s pieces; after `replay()`, start over with the whole window in smaller pieces.

        `loader.at_last_batch` is true only for the last piece of the last batch, so the window closes
        after the whole batch, not after its first piece.
        """
        self.current = batch
        if self.recording:
            self.window.append(batch)
        queue = deque(split_batch(batch, self.factor) if self.factor > 1 else [batch])
        while queue:
            piece = queue.popleft()
            loader.at_last_batch = last and not queue
            yield piece
            if self._restart:
                self._restart = False
                queue = deque(p for b in self.window for p in split_batch(b, self.factor))

    def piece_size(self) -> int | None:
        sizes = [batch_size_of(b) for b in self.window]
        return max((math.ceil(s / self.factor) for s in sizes if s is not None), default=None)

    def start_recording(self) -> None:
        """The loop uses `accumulate()`: keep the window from the batch being processed on."""
        if not self.recording:
            self.recording = True
            self.window = [self.current]

    def replay(self) -> None:
        self.factor *= 2
        self._restart = True

    def close_window(self) -> None:
        self.window.clear()


class OomBackoff:
    """The Accelerator's out-of-memory back-off (see the module notes).

    `settings()` is the run's current config, `process` this process's place in the run,
    `gradient_state` the accumulation window it doubles, `prepared` the engine, loaders and
    optimizers it resets."""

    def __init__(self, *, settings: Callable[[], Any], process: Any, gradient_state: Any, prepared: Any,
                 max_backoffs: int = MAX_BACKOFFS):
        self.settings, self.process = settings, process
        self.gradient_state, self.prepared = gradient_state, prepared
        self.max_backoffs = max_backoffs
        self.backoffs = 0
        self.phase = "idle"
        """forward (until the agreement), backward, after-backward: where an OOM now would land."""

    # --- the two hooks the Accelerator calls ----------------------------------------------------
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around one `accumulate()` block: back off on an OOM, else close the loader's window on sync."""
        if not self.settings().batch.oom_backoff:  # opted out: no window, and `phase` stays idle (no agreement)
            yield
            return
        self.phase = "forward"
        loader = self._loader()
        if loader is not None:
            loader.splitter.start_recording()
        try:
            yield
        except (torch.OutOfMemoryError, PeerOutOfMemory) as e:
            self._handle(e)
        else:
            if loader is not None and self.gradient_state.sync_gradients:
                loader.splitter.close_window()
        finally:
            self.phase = "idle"

    def before_backward(self) -> None:
        """The agreement point of a healthy rank (world > 1); raises PeerOutOfMemory if any rank failed.

        Skipped where a forward OOM is not recoverable anyway (the failing rank does not wait for it)."""
        if self.phase == "forward" and self._silent_forward() and self._agree(False):
            raise PeerOutOfMemory()
        if self.phase != "idle":
            self.phase = "backward"

    def after_backward(self) -> None:
        if self.phase != "idle":
            self.phase = "after-backward"

    # --- recovery -------------------------------------------------------------------------------
    def _loader(self) -> Any:
        loaders = self.gradient_state.active_dataloaders
        return loaders[-1] if loaders and getattr(loaders[-1], "splitter", None) is not None else None

    def _world(self) -> int:
        return self.process.num_processes

    def _agree(self, failed: bool) -> bool:
        """True when any rank failed (one all-reduce; no collective at all on one rank)."""
        if self._world() == 1:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.process.device)
        with named("all_reduce of the out-of-memory flag (batch.oom_backoff)", self.process.process_index):
            dist.all_reduce(flag)  # host sync on purpose: the answer decides which collectives come next
        return bool(flag.item() > 0)

    def _silent_forward(self) -> bool:
        """Forward runs no collective (stage 0-2 without optimizer offload, or one rank), in any trained model."""
        return self._world() == 1 or not any(e.forward_communicates for e in self.prepared.trained_engines())

    def _handle(self, error: BaseException) -> None:
        rank = self.process.process_index
        engines = self.prepared.trained_engines()
        engine = engines[0] if engines else None  # the advice names the first trained model
        peer = isinstance(error, PeerOutOfMemory)
        phase = self.phase
        if not peer:
            traceback.clear_frames(error.__traceback__)  # the failed forward's locals hold its activations
            where = {"forward": "forward", "backward": "backward", "after-backward": "the optimizer step"}[phase]
            started = any(e.update_started for e in engines)  # host steps began during backward
            recoverable = phase != "after-backward" and not started and (
                self._world() == 1 or (phase == "forward" and self._silent_forward()))
            if not recoverable:
                why = self._why("after-backward" if started else phase)
                raise EngineError(f"rank {rank}: CUDA out of memory in {where}, where zerofit cannot back off "
                                  f"safely ({why}). {self._advice(engine)}") from error
            if self._world() > 1:
                self._agree(True)
        loader = self._loader()
        if loader is None:
            raise EngineError(f"rank {rank}: out of memory, and the batch did not come from a DataLoader prepared "
                              f"by this Accelerator, so zerofit cannot replay it smaller. {self._advice(engine)}"
                              ) from (None if peer else error)
        for e in engines:
            discard_partial_step(e)
        piece = loader.splitter.piece_size()
        old_accum = self.gradient_state.gradient_accumulation_steps
        if self.backoffs >= self.max_backoffs or piece is None or piece < 2:
            reason = (f"it backed off {self.backoffs} times already (the most allowed)"
                      if self.backoffs >= self.max_backoffs else f"the micro-batch is {piece} and cannot be halved")
            raise EngineError(f"rank {rank}: out of memory and {reason}. {self._advice(engine)}") \
                from (None if peer else error)
        self.backoffs += 1
        loader.splitter.replay()
        window = self.gradient_state.window  # the engine's too (see zerofit.engine.window)
        window.steps, window.micro_step = old_accum * 2, 0
        for opt in self.prepared.optimizers:
            opt.window_open = False
        cause = "another rank ran out of memory" if peer else f"CUDA out of memory in {phase}"
        print(f"zerofit: rank {rank}: {cause}: backing off {self.backoffs}/{self.max_backoffs}: micro-batch "
              f"{piece} -> {math.ceil(piece / 2)}, gradient accumulation {old_accum} -> {old_accum * 2} (global batch "
              f"unchanged); replaying the window's {len(loader.splitter.window)} batch(es)", file=sys.stderr,
              flush=True)

    @staticmethod
    def _why(phase: str) -> str:
        if phase == "after-backward":
            return "the optimizer may have updated part of the parameters"
        if phase == "backward":
            return "gradient reductions between the ranks were under way"
        return "parameter gathers between the ranks run in forward under stage 3 or optimizer offload"

    def _advice(self, engine: Any) -> str:
        from zerofit.plan.advice import memory_advice

        return memory_advice(self.settings(), engine.model if engine is not None else None, world=self._world())
