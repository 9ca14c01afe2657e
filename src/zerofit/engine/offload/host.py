"""`HostStep`: host-stepped offload - offloaded groups step on the host, overlapped with forward.

Each offloaded flat group's step runs on `HostStepper`'s worker thread (see [Note: overlapped host
step] in zerofit.engine.offload.host_thread); the next forward waits for a unit's groups just before it uses
them, and publishes their parameters (all-gathering them where they are replicated). The groups
that stay on the device (`offload_optimizer.ratio` below 1) are stepped by `inner`, a `PlainStep`
or `CompactStep` over a smaller optimizer sharing the script optimizer's state (or by the GPU-stepped
part around it: see [Note: offload parts] in zerofit.engine.offload.part).

[Note: host steps during backward]
When the step's gradient factor is known before backward ends - no clipping, no fp16 loss
scale (so the factor is exactly 1), no NVMe - an offloaded group's host step can start as soon
as its reduced gradient is on its way to the host, overlapping the rest of backward; the
result is the same update, bit for bit. Three things a script could still do would change it
after the fact, so the engine only starts early once it has seen a whole step without them:
calling clip_grad_norm_ (from then on never early; a first call in an early window raises
if clipping would bite), changing lr & co. between backward and step() (detected at
step(): warned, and never early again) and running backward again after the backward that
closed the window (never early again; in an early window it raises). Only units all of whose
parameters got a gradient in that backward start early; the others step in step(), which
knows which parameters no rank gave a gradient (see [Note: parameters without a gradient]).
"""

from __future__ import annotations

import warnings
from collections import deque

import torch
from torch import nn

from zerofit.config.schema import AioConfig, OffloadConfig
from zerofit.engine.comm import Collectives, InFlight, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.host_thread import HostStepper
from zerofit.engine.offload.part import OffloadPart
from zerofit.engine.optim import global_grad_sumsq
from zerofit.engine.state_codec import Codec
from zerofit.engine.step_mode import StepFactors, StepMode, gather_params
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit
from zerofit.errors import EngineError


class HostStep(OffloadPart):
    """Host-stepped offload: `groups` step on the host worker, `inner` steps the rest (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], inner: StepMode, *,
                 model: nn.Module, units: list[Unit], trainable: list[FlatGroup], comm: Collectives,
                 reductions: InFlight, times: StepTimes, offload: OffloadConfig, aio: AioConfig,
                 needs_norm: bool, codec: Codec | None = None):
        """`trainable`: every trainable group, in unit order (the gradient norm's summation order);
        `needs_norm`: the step depends on the global gradient norm (clipping or fp16); `codec`: how the
        optimizer state is stored (see [Note: narrow state on the host] in zerofit.engine.offload.host_narrow)."""
        super().__init__(optimizer, groups, inner, model=model, units=units, comm=comm, times=times)
        self.trainable = trainable
        self.reductions = reductions
        self.codec = codec or Codec()
        self.stepper = HostStepper(optimizer, groups, comm.device, times, self.codec)
        self._unpublished: set[int] = set()
        """Groups stepped on the host whose parameters the next forward must still publish."""
        # After every sub-optimizer matched its pieces (`inner`'s too).
        self.swapper = self._nvme_swapper(offload, aio, self.codec)
        if self.swapper is not None:
            self.stepper.swap = self.swapper
            self._settle_before_read(self.stepper.settle_state)  # the stepper's: the worker must not keep us alive
        # The worker thread holds the stepper forever: stop it (and remove NVMe files) with this mode.
        self._close_with_self(self.stepper.close)
        self.early_off: str | None = None
        """Why host steps may not start during backward (None: they may; see the module note)."""
        if self.swapper is not None:
            self.early_off = "NVMe offload"
        elif needs_norm:
            self.early_off = "the step depends on the global gradient norm (clipping, fp16 or skip_nonfinite_steps)"
        self._early_now = False
        """This backward closes the window and hands groups to the worker as their gradients arrive."""
        self._early_groups: set[int] = set()
        """Groups whose step for this window was handed to the worker during backward."""
        self._early_hyper: list[dict] | None = None
        """The optimizer settings the early steps of this window used (checked again at step())."""
        self._to_submit: deque[tuple[list[Pending], list[FlatGroup]]] = deque()
        """Early steps waiting for their gradient reduction to be issued, in reduction order."""
        self._steps_taken = 0
        self._clip_seen = False
        self._window_closed = False
        """A backward closed this window and no step or zero_grad followed yet."""

    # --- backward -------------------------------------------------------------------------------
    def _begin_backward(self, sync: bool) -> None:
        # Units this forward skipped publish now, in unit order: a skipped last unit would otherwise
        # publish only at step(), after this backward's reductions, and not where the other ranks do
        # (see [Note: one collective order] in zerofit.engine.engine).
        self._await_all()
        if self._window_closed:  # a second backward after the one that closed the window, before step()
            if self._early_groups:
                raise EngineError(
                    f"backward ran again after the backward that closed accumulation window {self._steps_taken + 1}, "
                    "and zerofit had already applied that window's update to offloaded state during it: "
                    "call backward once per optimizer step from the first step on (sum the losses, or run "
                    "the earlier backward calls under accelerator.no_sync() / accelerator.accumulate()), "
                    "or set gradient_clipping in the config (then no update starts during backward)")
            self.early_off = "backward runs more than once per optimizer step"  # quietly: same results
        self._window_closed = sync
        self._early_now = sync and self.early_off is None and self._steps_taken > 0 and not self._clip_seen

    def _reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        hosted = [g for g in unit.trainable if g.placement.host_stepped]
        # Only a unit all of whose parameters got a gradient here starts early: none of them can be
        # left out of the step (see [Note: parameters without a gradient] in zerofit.engine.unused_params).
        if self._early_now and hosted and unit.all_reported:
            self._to_submit.append((pendings, hosted))
        self._submit_ready()

    def _end_backward(self) -> None:
        # Offloaded gradients: the staging buffers are reused by the next micro-step, so their
        # contents must reach the host gradient shards now (waits for the downloads in flight).
        self.reductions.drain()
        self._submit_ready()
        with self.times.measure("wait_grad_download"):
            for g in self.groups:
                if id(g) not in self._early_groups:
                    g.settle_host_grad()

    def _submit_ready(self) -> None:
        """Hand the host steps whose gradient reduction has been issued to the worker, in order."""
        while self._to_submit and all(p.done for p in self._to_submit[0][0]):
            self._submit_early(self._to_submit.popleft()[1], settle_grads=True)

    def _submit_early(self, groups: list[FlatGroup], *, settle_grads: bool) -> None:
        if not groups:
            return
        if self._early_hyper is None:
            self._early_hyper = self.stepper.hyperparams()
        self.stepper.submit(groups, None, hyper=self._early_hyper, settle_grads=settle_grads, early=True)
        for g in groups:
            self._early_groups.add(id(g))
            self._unpublished.add(id(g))
        self.times.host_steps_in_backward += len(groups)

    def _disable_early(self, reason: str, *, stacklevel: int) -> None:
        if self.early_off is None:
            warnings.warn(f"zerofit: {reason}; host optimizer steps no longer start during backward "
                          "(slower, same results from now on)", stacklevel=stacklevel)
        self.early_off = reason

    # --- step -----------------------------------------------------------------------------------
    def _clip_requested(self, max_norm: float) -> torch.Tensor | None:
        self._clip_seen = True
        if not self._early_groups:
            return None
        # The norm of a window whose host steps already ran: nothing is left to clip.
        self.stepper.wait_all()
        norm = global_grad_sumsq(self.trainable, self.comm, self.comm.device).sqrt()
        if max_norm > 0 and float(norm) > max_norm:
            raise EngineError(
                f"clip_grad_norm_(max_norm={max_norm}) was first called at optimizer step {self._steps_taken + 1}, "
                "after zerofit had already applied this step's update during backward "
                f"(gradient norm {float(norm):.4g}): "
                f"set gradient_clipping: {max_norm} in the config (zerofit then clips inside every step), or call "
                "clip_grad_norm_ from the first step on")
        return norm

    def _prepare_grads(self) -> None:
        self.settle()
        for g in self.groups:
            g.grads_for_step()

    def _begin_step(self) -> bool:
        self._steps_taken += 1
        return bool(self._early_groups)

    def _before_inner_step(self, factors: StepFactors) -> None:
        if not self._early_groups:
            return
        # The host part started during backward: the groups backward did not complete step now, with the
        # same settings and a factor of 1; the device part is left (the inner mode's step).
        if not _same_settings(self.stepper.hyperparams(), self._early_hyper):
            self._disable_early("the optimizer's settings (lr & co.) changed between backward and step(); "
                                "this step used the values they had when backward ended", stacklevel=4)
        rest = [g for g in self.groups if id(g) not in self._early_groups]
        for g in rest:
            g.grads_for_step()
            self._unpublished.add(id(g))
        self.stepper.submit(rest, None, hyper=self._early_hyper)
        self._early_hyper = None

    def _step(self, factors: StepFactors) -> None:
        if self._early_groups:  # handed over in `_before_inner_step`
            self._early_groups = set()
            return
        self._unpublished = {id(g) for g in self.groups}
        if self.swapper is not None:
            self.swapper.evict_materialized()  # inspected or loaded state goes back to its files
        # unit order = forward order: the units needed first are stepped first
        self.stepper.submit(self.groups, factors.remaining)

    def _zero_grad(self) -> None:
        self._window_closed = False

    # --- settling -------------------------------------------------------------------------------
    def _nothing_pending(self) -> bool:
        return not self._unpublished

    def _await_group(self, g: FlatGroup) -> Pending | None:
        """Wait for `g`'s host step; the all-gather of its parameters, if any (on the main thread)."""
        if id(g) not in self._unpublished:
            return None
        self._unpublished.discard(id(g))
        self.stepper.wait(g)
        return gather_params(g, self.comm)

    def _settle(self, *, state: bool) -> None:
        self.stepper.wait_all()
        self._await_all()
        if state and self.swapper is not None:
            self.swapper.materialize()

    def _update_started(self) -> bool:
        return bool(self._early_groups)  # handed to the worker during backward: masters may be updated

    def _discard(self) -> None:
        for g in self.groups:
            g.settle_host_grad()  # a download still in flight must not land in the next window
        self._to_submit.clear()  # early steps not handed to the worker yet belong to the discarded window
        self._early_now = False


def _same_settings(a: list[dict], b: list[dict]) -> bool:
    """Param-group settings equal value for value (lr may be a tensor)."""
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return len(a) == len(b) and all(ga.keys() == gb.keys() and all(same(ga[k], gb[k]) for k in ga)
                                    for ga, gb in zip(a, b))
