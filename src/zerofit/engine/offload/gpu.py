"""`GpuStep`: GPU-stepped optimizer offload - state in host memory, stepped on the device in chunks.

[Note: GPU-stepped offload]
A GPU-stepped group keeps its fp32 master and optimizer state in page-locked host memory and its
gradient shard on the device. `step()` streams that state through a small pool of device buffers
(`STREAM_SLOTS` slots of up to `STREAM_CHUNK` elements), group by group in forward order, chunk by
chunk, on three side streams:
  upload:   master and state chunk, host -> slot        (once the slot's previous download is done)
  step:     the script's optimizer class steps the slot from the gradient chunk, with the window's
            unscale/clip factor applied as on the device; the updated master is cast into the
            parameter shard and the gradient chunk is zeroed
  download: master and state chunk, slot -> host        (then the slot is free again)
so copies both ways and the kernels overlap, and the main stream goes on to the next forward, which
waits per unit (a forward pre-hook, as with host steps) only for the groups it is about to use. The
kernel is the one the no-offload path runs on the same elements, gradients and factor, so the update
is the same bit for bit. Only the state crosses the bus (no gradient download, no parameter upload),
and the CPU cores stay free.

A chunk lies inside one run - consecutive optimizer pieces of one param group (see [Note: runs] in
zerofit.engine.offload.gpu_runs) - so it steps with that group's settings; each piece (or part of one) in
it is one tensor of that step, from a copy of the piece's scalar state (Adam's `step`), and the piece
keeps its last part's. On a piece's first step its parts start with no state and the optimizer
creates it as it would on the whole piece (zeros for Adam's moments, the gradient for SGD's
momentum); it is kept in the run's host homes from then on, where checkpoints find it. A piece whose
parameter no rank gave a gradient is left out of the step; its elements travel there and back
unchanged (see [Note: parameters without a gradient] in zerofit.engine.unused_params).
Host-side readers call `settle(state=True)`, which waits for
the downloads in flight; gradients are zeroed by the step itself (`FlatGroup.step_in_flight`).

With bf16 parameters on the device the master does not cross whole: the host keeps its low halves and
carries and the device rebuilds it from the parameter it holds (see [Note: split master] in
zerofit.engine.offload.master_split), 2.125 bytes instead of 4 each way and at rest ([Note: packed master at
rest] in zerofit.engine.offload.packed_master); `settle(state=True)` rebuilds the fp32 masters in host memory
for host readers (checkpoints one group at a time), and the next step uploads those whole.

The main thread only decides the step (factor, this step's settings, the "gradients final" event) and
hands the groups to `IssueThread`, which queues their chunks (see [Note: issuing off the main thread]
in zerofit.engine.offload.gpu_issue); a unit's pre-hook waits until its groups are queued.

[Note: narrow state in the stream]
With `precision.optimizer_state` bf16 or 8bit (see [Note: narrow optimizer state] in
zerofit.engine.state_codec) a run's homes hold the stored form (`offload/stored_homes.py`); a chunk's codes
(and block scales) travel instead of fp32 state - 2 or 1.25 bytes per element instead of 4 - and the step
stream widens them into the slot's fp32 buffers, steps, zeroes the padding between pieces and narrows them
again before the download. Groups kept on the device join this stream too, with their homes in device memory
(no copy: widened from and narrowed into the home itself), so one path steps narrow state wherever it lives.

[Note: resident chunks]
A chunk of such a group (master and state on the device) needs no link: it runs wholly on the step stream, in
a slot of its own (`_home_slot`: the fp32 state it widens into), its master stepped where it lies (copied to
the slot only when its start is not where a slot would put it: [Note: chunk alignment] in
zerofit.engine.offload.gpu_runs). So it never waits for a ring slot's download, and the ring carries only
chunks that cross the link. `step()` issues the two kinds merged in proportion to their elements
(`interleaved`: each kind keeps forward order), so the copy engines start on the first offloaded chunk at
once and the device chunks' kernels run while the link is busy; issued in forward order, the device groups
came first and the link idled while they were stepped (~0.2 s a step of a 9 B model with half its state
offloaded). Values do not change: each group's chunks see the same inputs in either order.

With NVMe the state's home is a file per group (see [Note: GPU-stepped offload from NVMe] in
zerofit.engine.offload.nvme).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn

from zerofit.config.schema import AioConfig, OffloadConfig
from zerofit.engine import fused_kernels
from zerofit.engine.comm import Collectives, InFlight, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload import master_split
from zerofit.engine.offload.chunk_optimizer import ChunkOptimizers
from zerofit.engine.offload.early import EarlyStart, current_settings, offload_off
from zerofit.engine.offload.gpu_homes import PieceState, RunHomes
from zerofit.engine.offload.gpu_issue import IssueThread, interleaved
from zerofit.engine.offload.gpu_runs import (  # noqa: F401 - ChunkSpan and plan_chunks: public here too
    VECTOR,
    ChunkSpan,
    Run,
    aligned_chunk,
    bind,
    is_streamed,
    plan_chunks,
    plan_runs,
)
from zerofit.engine.offload.gpu_slot import Slot
from zerofit.engine.offload.handover import Handover
from zerofit.engine.offload.nvme import NvmeSwapper
from zerofit.engine.offload.packed_master import PackedMasters
from zerofit.engine.offload.packed_master import carries as packed_carries
from zerofit.engine.offload.packed_master import low as packed_low
from zerofit.engine.offload.part import OffloadPart
from zerofit.engine.offload.stored_homes import bind_stored, gap_index
from zerofit.engine.offload.warm_kernels import warm
from zerofit.engine.optim import folds_grad_scale, global_grad_sumsq, step_with_factor
from zerofit.engine.state_codec import Codec, Stored, blocks
from zerofit.engine.step_mode import StepFactors, StepMode, gather_params
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit

# Public: the memory model (zerofit.plan) counts the pool from these.
STREAM_CHUNK = 1 << 26  # elements per chunk (64 M): see [Note: chunk size] in zerofit.engine.offload.gpu_runs
STREAM_SLOTS = 3  # chunks in flight: one uploading, one stepping, one downloading
def stream_pool_bytes(largest_piece: int, *, state_tensors: int, compact: bool,
                      offload_params: bool, compute_bytes: int, split: bool = False, fused: bool = False) -> int:
    """Device bytes of the ring of slots the chunks crossing the link use: per slot, fp32 master + state chunks
    (+ the fp32 gradient upcast when gradients are compact, + the compute-dtype parameter chunk on its way down
    with param offload, + the packed master when it travels split, and the carries' scratch unless `fused`: the
    fused kernels need none). `largest_piece`: the largest run of an offloaded group (at most its shard)."""
    n = min(STREAM_CHUNK, largest_piece)
    per_slot = (home_slot_bytes(largest_piece, state_tensors=state_tensors, compact=compact)
                + (n * compute_bytes if offload_params else 0))
    if split:
        per_slot += master_split.packed_bytes(n) + (0 if fused else master_split.scratch_bytes(n))
    return STREAM_SLOTS * per_slot


def home_slot_bytes(largest_piece: int, *, state_tensors: int, compact: bool) -> int:
    """Device bytes of the slot of chunks whose master and state stay on the device ([Note: resident chunks]): the
    fp32 state chunks, the master (for a chunk not aligned as a slot's would be) and, compact, the upcast gradient
    - what every slot of the ring holds too (`stream_pool_bytes`). `largest_piece`: the largest run of such a
    group."""
    return min(STREAM_CHUNK, largest_piece) * 4 * (1 + state_tensors + (1 if compact else 0))


class GpuStep(OffloadPart):
    """GPU-stepped offload of `groups`; `inner` steps the groups that stay on the device (module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], inner: StepMode, *,
                 model: nn.Module, units: list[Unit], comm: Collectives, times: StepTimes,
                 offload: OffloadConfig | None = None, aio: AioConfig | None = None,
                 chunk: int | None = None, slots: int = STREAM_SLOTS, codec: Codec | None = None,
                 trainable: list[FlatGroup] | None = None, reductions: InFlight | None = None,
                 needs_norm: bool = True):
        """`offload`, `aio`: with `offload.device` "nvme" the state's home is a file per group (see [Note:
        GPU-stepped offload from NVMe] in zerofit.engine.offload.nvme); `chunk`: elements per chunk (default
        `STREAM_CHUNK`, read when the mode is built); `codec`: how the state is stored (see [Note: narrow state in the
        stream]); groups not offloaded keep it on the device. `trainable` (every trainable group, in unit order),
        `reductions` and `needs_norm` (the step depends on the global gradient norm): for updates started during
        backward (see [Note: updates during backward] in zerofit.engine.offload.early; never without them)."""
        super().__init__(optimizer, groups, inner, model=model, units=units, comm=comm, times=times)
        self.codec = codec or Codec()
        resident = {id(g) for g in groups if not g.placement.offloaded}
        """Groups whose master and state stay on the device (narrow state: stepped in the stream too)."""
        self._gaps: dict[tuple[int, int], torch.Tensor | None] = {}
        chunk = chunk or STREAM_CHUNK
        self.device = comm.device
        self._cuda = self.device.type == "cuda"
        # One stream per direction and one for the kernels, so the three overlap (none is the main stream).
        self._up, self._work, self._down = ([torch.cuda.Stream(device=self.device) for _ in range(3)]
                                            if self._cuda else (None, None, None))
        chunk = aligned_chunk(chunk)
        self._runs: dict[int, list[Run]] = {id(g): plan_runs(g, optimizer, chunk) for g in groups}
        """Per group: its runs of pieces, each with its chunks (see [Note: runs] in zerofit.engine.offload.gpu_runs)."""
        def largest(on_device: bool) -> int:
            return max((r.end - r.start for g in groups if (id(g) in resident) == on_device
                        for r in self._runs[id(g)]), default=1)
        crossing, kept = min(chunk, largest(False)), min(chunk, largest(True))
        self._slots = [Slot(crossing, self.device) for _ in range(max(1, slots))]
        self._resident = resident
        self._home_slot = Slot(kept, self.device) if resident else None
        """The buffers of chunks whose master and state are on the device ([Note: resident chunks])."""
        self._order = interleaved(groups, resident)
        """The order `step()` issues the groups in ([Note: resident chunks])."""
        self._index = (torch.empty(max(crossing, kept), dtype=torch.int32, device=self.device)
                       if self.codec.scaled and not fused_kernels.serves(self.device) else None)
        """The 8-bit codec's scratch: one for every slot, as only the step stream uses it ([Note: codec scratch]);
        none where the fused kernels store and widen ([Note: fused kernels])."""
        self._next_slot = 0
        self._opts = ChunkOptimizers(optimizer, self.device)
        self._done: dict[int, object] = {}
        """Per group in flight: the event after which its parameters are published and gradient zeroed."""
        self._written = None
        """Event: every download of the last step is done (host master and state hold its values)."""
        self._keep: list = []
        """Tensors the side streams still read (the step's factor), held until the next step."""
        self._backward_ran = False
        self.swapper = self._nvme_swapper(offload, aio, self.codec)  # after the pieces were matched (`plan_runs`)
        self.trainable, self.reductions = trainable or [], reductions
        off = offload_off(nvme=self.swapper is not None, needs_norm=needs_norm)
        if trainable is None or reductions is None:
            off = "built without the engine's gradient reductions"
        self.early = EarlyStart(off, "GPU-stepped optimizer steps")
        self._window_written = None
        """`_written` when this window's backward began (what its early uploads wait for)."""
        self._zeroing = True
        """Issuing thread: the group being issued zeroes its gradient as it steps (not when started early)."""
        self._unzeroed: set[int] = set()
        """Groups stepped during backward whose gradients are zeroed when next awaited (after step())."""
        self._splits = {id(g) for g in groups if self._can_split(g)}
        """Groups whose master travels split (see [Note: split master] in zerofit.engine.offload.master_split),
        kept packed in host memory between steps ([Note: packed master at rest])."""
        if any((g.packed_master is not None) != (id(g) in self._splits) for g in groups):
            raise AssertionError("the groups packed when built are not those whose master travels split (an engine "
                                 "bug: `policy.packs_master` and `GpuStep._can_split` disagree)")
        self.packed = PackedMasters([g for g in groups if id(g) in self._splits])
        self.handover = Handover(units, groups, self.device, comm.world)  # [Note: handover]
        self._homes = RunHomes(optimizer, self.codec, self.device, resident=resident, swapped=self.swapper is not None)
        """Where each run's state lives (see [Note: verified homes] in zerofit.engine.offload.gpu_homes)."""
        if self.swapper is None:  # now, not inside the first steps (see [Note: homes at prepare])
            for g in groups:
                self._homes.allocate(g, self._runs[id(g)])
        self.issuer = IssueThread(groups, self.device)
        if self._cuda:  # compiled now, not in the first step's stream ([Note: kernel warm-up])
            warm(self.device, self.codec, bool(self._splits))
        # The thread never holds this mode while idle; stop it (and remove the NVMe files) with the mode,
        # or at the latest when the process exits.
        self._close_with_self(_close, self.issuer, self.swapper)
        self._settle_before_read(self._settle_state)  # checkpoints read and write host state: no copy in flight

    # --- the part's own hooks (after the inner mode's) ----------------------------------------------
    def _compact(self) -> bool:
        return any(g.compact for g in self.groups)

    def _begin_backward(self, sync: bool) -> None:
        self._await_all()  # units forward did not use: backward (or its end) may touch their gradients
        if self._backward_ran:  # a second backward in this window: sums must not round (see CompactStep)
            self.widen()
        self._backward_ran = True
        self.early.begin_backward(sync)
        self.handover.begin_backward(sync=sync, early=self.early.now)
        self._window_written = self._written  # the issuing thread is idle (all awaited)

    def _reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        mine = [g for g in unit.trainable if id(g) in self._runs]
        self.early.offer(unit, pendings, mine)
        self._submit_ready()

    def _end_backward(self) -> None:
        self.early.end_backward()
        if self.early.now:
            self.reductions.drain()  # the last units' reductions: their groups start before step()
            self._submit_ready()

    def _submit_ready(self) -> None:
        groups = self.early.ready(lambda: current_settings(self.optimizer))
        if groups:
            self._launch(groups, StepFactors(), self.early.settings, {id(g): frozenset() for g in groups},
                         written=self._window_written, zero_grads=False)
            self.times.gpu_steps_in_backward += len(groups)

    def _clip_requested(self, max_norm: float) -> torch.Tensor | None:
        def norm() -> torch.Tensor:  # of a window already stepped: its gradients are kept until step()
            self._await_all()
            return global_grad_sumsq(self.trainable, self.comm, self.device).sqrt()
        return self.early.clip_requested(max_norm, norm)

    def _before_inner_step(self, factors: StepFactors) -> None:
        if not self._early_step:
            return
        # Started during backward: the groups backward did not complete step now, with the same settings and a
        # factor of 1, and the early ones zero their gradients when next awaited (this window's are read until
        # step(): clip_grad_norm_, inspection)
        started = self.early.started
        settings = self.early.check_settings(current_settings(self.optimizer), stacklevel=4)
        self._unzeroed.update(id(g) for g in self.groups if id(g) in started and g.step_in_flight)
        rest = [g for g in self.groups if id(g) not in started]
        if rest:
            self._launch(rest, StepFactors(), settings, {id(g): g.unused for g in rest}, written=self._window_written)

    def _discard(self) -> None:
        self.early.discard()

    def _zero_grad(self) -> None:
        self._backward_ran = False
        self.early.zero_grad()

    def _widen(self) -> None:
        for g in self.groups:
            if g.compact:
                self._await_group(g)
                g.widen()

    # --- the step -------------------------------------------------------------------------------
    def _step(self, factors: StepFactors) -> None:
        self.handover.armed = True  # the stream's slots exist from this step on
        if self._early_step:  # handed over during backward and in `_before_inner_step`
            self._early_step = False
            return
        self._await_all()  # a group still in flight (never used since the last step) finishes first
        self._keep = [f for f in (factors.whole, factors.remaining) if isinstance(f, torch.Tensor)]
        if self.swapper is not None:
            self.swapper.evict_materialized()  # inspected or loaded state goes back to its files
            self.swapper.schedule(self._order)  # the first reads start now
        # this step's lr & co., taken now: the script's scheduler moves on while the groups are issued
        # parameters no rank gave a gradient are left out of the update (see [Note: parameters without a
        # gradient]); their chunks still travel, so the host master keeps one form per group
        self._launch(self._order, factors, current_settings(self.optimizer), {id(g): g.unused for g in self.groups},
                     written=self._written)

    def _launch(self, groups: list[FlatGroup], factors: StepFactors, settings: list[dict],
                unused: dict[int, frozenset[int]], *, written, zero_grads: bool = True) -> None:
        """Hand `groups` to the issuing thread: their gradients and `factors` are final on the main stream now;
        their uploads wait for `written` (the downloads of the step before)."""
        ready = self._record(None)
        for g in groups:
            g.step_in_flight = True  # before zero_grad, which must leave these gradients to the step
        self.issuer.submit(groups, partial(self._issue, factors=factors, folded=folds_grad_scale(self.optimizer),
                                           settings=settings, unused=unused, ready=ready, written=written,
                                           zero_grads=zero_grads))

    def _issue(self, g: FlatGroup, *, factors: StepFactors, folded: bool, settings: list[dict],
               unused: dict[int, frozenset[int]], ready, written, zero_grads: bool) -> None:
        """On the issuing thread: queue `g`'s chunks on the side streams (swapped in from NVMe around them), after
        the events `ready` (gradients and factor final) and `written` (the last step's downloads)."""
        if written is not None:
            self._up.wait_event(written)  # host state holds the last step's values
        if ready is not None:
            self._work.wait_event(ready)
        self._zeroing = zero_grads
        if g.compact:  # upcast chunk by chunk; the whole factor goes with it
            scale, kernel = (None, factors.whole) if folded else (factors.whole, None)
        else:  # fp32 gradients were scaled in place already unless the kernel folds the factor
            scale, kernel = None, factors.remaining
        if self.swapper is not None:
            with self.times.measure("nvme_wait"):
                self.swapper.swap_in(g)  # master and state bound to a pinned slot (uploads are DMA)
        with self.times.measure("stream_issue"):
            for run in self._runs[id(g)]:
                self._step_run(g, run, scale, kernel, settings, unused[id(g)])
            if id(g) in self._resident and self._cuda:  # its homes (and any parameter) were written on the step stream
                self._down.wait_stream(self._work)
            self._done[id(g)] = self._record(self._down if g.placement.offload_params else self._work)
            downloaded = self._record(self._down)
            if id(g) in self._splits and id(g) not in self.packed.packed:  # it uploaded the fp32 master
                self.packed.stepped(g, self._record(self._up))
            self._written = downloaded  # the download stream is in order: the last group's covers all
        if self.swapper is not None:
            self.swapper.swap_out(g, ready=downloaded)  # written once the downloads into the slot are done

    def _step_run(self, g: FlatGroup, run: Run, scale, kernel, settings: list[dict], unused: frozenset[int]) -> None:
        """Stream `run` through the slots chunk by chunk and step its pieces, but those of `unused` parameters."""
        state = self.optimizer.state
        now = self._homes.of(g, run)  # the homes, and which pieces have state (see [Note: verified homes])
        homes = now.homes
        opt = self._opts.get(run.group, settings[run.group])
        split = id(g) in self._splits
        packed_home = id(g) in self.packed.packed  # the host holds the packed form (the last step split it)
        at_rest = g.packed_master  # its packed form's home (split groups)
        shard = g.master.numel()
        narrow = self.codec.narrow
        run_master = g.master[run.start:run.end]
        created: dict[int, dict[str, torch.dtype]] = {}
        """id(piece) -> the per-element state the optimizer created for it (its first step)."""
        last: dict[int, tuple] = {}
        """id(piece) -> (the piece, the scalar state of its last stepped part)."""
        on_device = id(g) in self._resident  # master and state on the device: no copies ([Note: resident chunks])
        held = self.handover.holds(g)  # its parameters gathered since backward: read and written there
        up, down = (self._work, self._work) if on_device else (self._up, self._down)
        for span in run.chunks:
            if on_device:
                slot = self._home_slot
            else:
                slot = self._slots[self._next_slot]
                self._next_slot = (self._next_slot + 1) % len(self._slots)
            lo, n = span.start - run.start, span.length
            wide = {k: slot.buf(k, _wide(home), n) for k, home in homes.items()}
            """Per state key: the slot's buffer the optimizer steps the chunk's state in."""
            at_home = now.chunk(lo, n)  # per state key: the chunk's elements in its home
            index = self._index[:n] if self._index is not None else None  # [Note: codec scratch]
            master_home = run_master[lo:lo + n]
            in_place = on_device and _starts_at(master_home, span.shift)  # stepped where it lies
            with self._on(up):
                if slot.free is not None:
                    up.wait_event(slot.free)
                master = master_home if in_place else slot.buf("master", torch.float32, n, span.shift)
                packed, carries = slot.packed(n) if split or packed_home else (None, None)
                # the parameter the master is split against: on the device, or (offloaded) its slot buffer, filled
                # now where a packed master is rebuilt from it (the step casts the new one into it)
                rounded = (g.param_flat[span.start:span.start + n] if held
                           else slot.buf("param", g.compute_dtype, n) if g.placement.offload_params
                           else g.param_shard[span.start:span.start + n])
                if packed_home:  # the low halves and carries come up; the device holds the rest
                    packed[:2 * n].copy_(packed_low(at_rest, shard, span.start, n), non_blocking=True)
                    packed[2 * n:].copy_(packed_carries(at_rest, shard, span.start, n), non_blocking=True)
                    if g.placement.offload_params and not held:
                        rounded.copy_(g.param_shard[span.start:span.start + n], non_blocking=True)
                elif not in_place:
                    master.copy_(master_home, non_blocking=True)
                staged = {}
                for k, home in at_home.items():
                    if isinstance(home, Stored):
                        staged[k] = self._staged(slot, k, home, n)
                    else:
                        wide[k].copy_(home, non_blocking=True)
                loaded = None if on_device else self._record(up)
            with self._on(self._work):
                if loaded is not None:
                    self._work.wait_event(loaded)
                if packed_home:
                    master_split.join(packed, rounded, master, carries)
                for k, stored in staged.items():  # widened: the optimizer steps fp32 state
                    self.codec.decode(stored, wide[k], k, scratch=index)
                new_keys = self._step_chunk(g, run, opt, span, master, rounded, slot, wide, now.pieces, unused, scale,
                                            kernel, created, last)
                if split:  # after the parameter is published: its rounding is what the carries refer to
                    master_split.split(master, rounded, packed, carries)
                if narrow:
                    for k in new_keys:  # state a fresh piece created under a key not seen before
                        if k not in homes:
                            homes[k] = self._homes.add(g, run, k, torch.float32)
                            wide[k] = slot.buf(k, torch.float32, n)
                            at_home[k] = homes[k].slice(lo, n)
                            staged[k] = self._staged(slot, k, at_home[k], n, upload=False)
                    gaps = self._gap(run, span)
                    for k, stored in staged.items():  # narrowed again, padding zeroed first
                        if gaps is not None:
                            wide[k].index_fill_(0, gaps, 0.0)
                        self.codec.encode(wide[k], stored, k, scratch=index, overwrite=True)
                stepped = None if on_device else self._record(self._work)
            with self._on(down):
                if stepped is not None:
                    down.wait_event(stepped)
                if not narrow:
                    for k, dtype in new_keys.items():  # state fresh pieces created: its home in host memory
                        if k not in homes:
                            homes[k] = self._homes.add(g, run, k, dtype)
                            wide[k] = slot.buf(k, dtype, n)
                            at_home[k] = homes[k][lo:lo + n]
                if split:
                    packed_low(at_rest, shard, span.start, n).copy_(packed[:2 * n], non_blocking=True)
                    packed_carries(at_rest, shard, span.start, n).copy_(packed[2 * n:], non_blocking=True)
                elif not in_place:
                    master_home.copy_(master, non_blocking=True)
                for k, home in at_home.items():  # every per-element state of the chunk is in its slot
                    if isinstance(home, Stored):
                        if home.codes.device != self.device:  # a device home was narrowed into in place
                            home.copy_(staged[k], non_blocking=True)
                    else:
                        home.copy_(wide[k], non_blocking=True)
                if g.placement.offload_params:
                    g.param_shard[span.start:span.start + n].copy_(rounded, non_blocking=True)
                slot.free = None if on_device else self._record(down)
        if created:
            for p in run.pieces:
                for k in created.get(id(p), ()):
                    if isinstance(homes[k], Stored):
                        bind_stored(run, state, k, homes[k], [p])
                    else:
                        bind(run, state, k, homes[k], [p])  # its values are on their way there
        for p, scalars in last.values():
            state[p.master].update(scalars)  # the piece's scalar state moves on as its last part's did
        self._homes.stepped(run, now, changed=bool(created))

    def _staged(self, slot: Slot, key: str, home: Stored, n: int, *, upload: bool = True) -> Stored:
        """Where a chunk's `n` elements in their home (`home`) are widened from and narrowed into: the home itself
        when it is on the device, else the slot's staging buffers (filled from the home now, on the upload stream)."""
        if home.codes.device == self.device:
            return home
        staged = Stored(slot.buf(key + "#codes", home.codes.dtype, n),
                        slot.buf(key + "#scale", torch.float32, blocks(n)) if home.scale is not None else None)
        if upload:
            staged.copy_(home, non_blocking=True)
        return staged

    def _gap(self, run: Run, span: ChunkSpan) -> torch.Tensor | None:
        key = (id(run), span.start)
        if key not in self._gaps:
            self._gaps[key] = gap_index(run, span.start, span.length, self.device)
        return self._gaps[key]

    def _step_chunk(self, g: FlatGroup, run: Run, opt: torch.optim.Optimizer, span: ChunkSpan, master: torch.Tensor,
                    param: torch.Tensor, slot: Slot, wide: dict[str, torch.Tensor], pieces: tuple[PieceState, ...],
                    unused: frozenset[int], scale, kernel, created: dict[int, dict],
                    last: dict[int, tuple]) -> dict[str, torch.dtype]:
        """Step the pieces in one chunk (on the step stream), one tensor each, in one call; publish the chunk
        into `param` (its parameters, or their slot buffer on the way down) and zero its gradient. `wide`: per
        state key, the slot's buffer of the chunk's state; `pieces`: per piece of the run, its state now. Returns
        the per-element state keys the optimizer created (now in the slot's buffers)."""
        n, s = span.length, span.start
        grad = grad_shard = g.grad_shard[s:s + n]
        if grad.dtype != torch.float32:  # compact gradient: upcast, exactly, into the slot
            grad = slot.buf("grad", torch.float32, n, span.shift).copy_(grad)
            if isinstance(scale, torch.Tensor):
                grad.mul_(scale.to(grad.device))
            elif scale is not None and scale != 1.0:
                grad.mul_(scale)
        views, parts, scalars = [], [], []
        for i, p, a, b in run.local_parts(span):
            if p.param in unused:
                continue  # left out: its elements go back as they came
            view = master[a:b]
            view.grad = grad[a:b]
            own = pieces[i]
            given: dict = {}
            if own.entry is not None:  # else its first step: the optimizer creates its state
                for k in own.held:
                    given[k] = wide[k][a:b]
                for k, v in own.entry.items():
                    if k not in own.skip:
                        scalars.append((given, k, v))
            views.append(view)
            parts.append((p, a, b, own.held, given))
            opt.state[view] = given
        new_keys: dict[str, torch.dtype] = {}
        if views:
            self._opts.scalar_copies(scalars, opt)
            befores = [dict(given) for *_, given in parts]
            opt.param_groups[0]["params"] = views
            try:
                step_with_factor(opt, kernel)
            finally:
                states = [opt.state.pop(view, {}) for view in views]
                for view in views:
                    view.grad = None
                opt.param_groups[0]["params"] = []
                opt.state.clear()
            for (p, a, b, held, _), before, new in zip(parts, befores, states):
                kept = {}
                for k, v in new.items():
                    if k in held and before[k] is v:
                        continue  # per-element state, stepped in place in its slot buffer
                    if not is_streamed(v, b - a):
                        kept[k] = v
                    elif before.get(k) is not v:  # new (a fresh piece), or replaced rather than updated in place
                        slot.buf(k, v.dtype, n)[a:b].copy_(v)  # into the slot: downloads are ordered on it
                        created.setdefault(id(p), {})[k] = v.dtype
                        new_keys[k] = v.dtype
                last[id(p)] = (p, kept)
        param.copy_(master)
        if self._zeroing:
            grad_shard.zero_()
        return new_keys

    # --- streams ----------------------------------------------------------------------------------
    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _record(self, stream):
        """An event recorded now on `stream` (None: the current stream); None on CPU (all synchronous)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    # --- settling ---------------------------------------------------------------------------------
    def _await_group(self, g: FlatGroup) -> Pending | None:
        """The main stream waits for `g`'s update; returns the all-gather of its parameters, if any."""
        if not g.step_in_flight:
            return None
        with self.times.measure("wait_stream_issue"):
            self.issuer.wait(g)  # raises what the issuing thread raised
        g.step_in_flight = False
        event = self._done.pop(id(g), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        if id(g) in self._unzeroed:  # stepped during backward, after step(): the window is over
            self._unzeroed.discard(id(g))
            g.grad_shard.zero_()
        return gather_params(g, self.comm)  # collectives stay on the main thread, in unit order

    def _settle(self, *, state: bool) -> None:
        self._await_all()
        if state:
            self.issuer.wait_all()  # a failure of the last step is raised here, not hidden
            if self._written is not None:
                self._written.synchronize()  # host masters and state hold the last step's values
            if self.swapper is not None:
                self.swapper.materialize()  # after the writes: in host memory until the next step
            self.packed.join_all()

    def reader(self):
        return self.swapper if self.swapper is not None else (self.packed if self.packed.groups else None)

    def _settle_state(self) -> None:
        self.settle(state=True)

    # --- the split master (see [Note: split master]) ----------------------------------------------
    def _can_split(self, g: FlatGroup) -> bool:
        """`g`'s master may travel split: bf16 parameters (on the device, or offloaded: then uploaded beside it),
        no NVMe file, the master in host memory."""
        return (self.swapper is None and g.placement.offloaded
                and master_split.eligible(g.compute_dtype, g.master, g.param_shard))


def _starts_at(t: torch.Tensor, shift: int) -> bool:
    """`t` starts `shift` elements past a 16-byte boundary (as a slot's buffer would: [Note: chunk alignment])."""
    return t.data_ptr() % 16 == shift * t.element_size() % 16


def _wide(home: torch.Tensor | Stored) -> torch.dtype:
    """The dtype the optimizer steps a home's state in: fp32 for stored state, else the home's own."""
    return torch.float32 if isinstance(home, Stored) else home.dtype


def _close(issuer: IssueThread, swapper: NvmeSwapper | None) -> None:
    issuer.close()
    if swapper is not None:
        swapper.close()
