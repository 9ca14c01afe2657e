"""`HostStep`: host-stepped offload - offloaded groups step on the host, overlapped with forward.

Each offloaded flat group's step runs on `HostStepper`'s worker thread (see [Note: overlapped host
step] in zerofit.engine.offload.host_thread); the next forward waits for a unit's groups just before it uses
them, and publishes their parameters (all-gathering them where they are replicated). The groups
that stay on the device (`offload_optimizer.ratio` below 1) are stepped by `inner`, a `PlainStep`
or `CompactStep` over a smaller optimizer sharing the script optimizer's state (or by the GPU-stepped
part around it: see [Note: offload parts] in zerofit.engine.offload.part).

Host steps start during backward when the step's factor is known before backward ends (see [Note: updates
during backward] in zerofit.engine.offload.early); not with NVMe, whose reads the worker would block on.
"""

from __future__ import annotations

import torch
from torch import nn

from zerofit.config.schema import AioConfig, OffloadConfig
from zerofit.engine.comm import Collectives, InFlight, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.early import EarlyStart, current_settings, offload_off
from zerofit.engine.offload.host_thread import HostStepper
from zerofit.engine.offload.part import OffloadPart
from zerofit.engine.optim import global_grad_sumsq
from zerofit.engine.state_codec import Codec
from zerofit.engine.step_mode import StepFactors, StepMode, gather_params
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit


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
        self.early = EarlyStart(offload_off(nvme=self.swapper is not None, needs_norm=needs_norm),
                                "host optimizer steps")
        """Host steps started during backward (see [Note: updates during backward])."""

    # --- backward -------------------------------------------------------------------------------
    def _begin_backward(self, sync: bool) -> None:
        # Units this forward skipped publish now, in unit order: a skipped last unit would otherwise
        # publish only at step(), after this backward's reductions, and not where the other ranks do
        # (see [Note: one collective order] in zerofit.engine.engine).
        self._await_all()
        self.early.begin_backward(sync)

    def _reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        self.early.offer(unit, pendings, [g for g in unit.trainable if g.placement.host_stepped])
        self._submit_ready()

    def _end_backward(self) -> None:
        self.early.end_backward()
        # Offloaded gradients: the staging buffers are reused by the next micro-step, so their
        # contents must reach the host gradient shards now (waits for the downloads in flight).
        self.reductions.drain()
        self._submit_ready()
        with self.times.measure("wait_grad_download"):
            for g in self.groups:
                if id(g) not in self.early.started:
                    g.settle_host_grad()

    def _submit_ready(self) -> None:
        """Hand the host steps whose gradient reduction has been issued to the worker, in order."""
        groups = self.early.ready(lambda: current_settings(self.optimizer))
        if groups:
            self.stepper.submit(groups, None, hyper=self.early.settings, settle_grads=True, early=True)
            self._unpublished.update(id(g) for g in groups)
            self.times.host_steps_in_backward += len(groups)

    # --- step -----------------------------------------------------------------------------------
    def _clip_requested(self, max_norm: float) -> torch.Tensor | None:
        def norm() -> torch.Tensor:  # of a window whose host steps already ran: nothing is left to clip
            self.stepper.wait_all()
            return global_grad_sumsq(self.trainable, self.comm, self.comm.device).sqrt()
        return self.early.clip_requested(max_norm, norm)

    def _prepare_grads(self) -> None:
        self.settle()
        for g in self.groups:
            g.grads_for_step()

    def _before_inner_step(self, factors: StepFactors) -> None:
        if not self._early_step:
            return
        # The host part started during backward: the groups backward did not complete step now, with the
        # same settings and a factor of 1; the device part is left (the inner mode's step).
        rest = [g for g in self.groups if id(g) not in self.early.started]
        settings = self.early.check_settings(current_settings(self.optimizer), stacklevel=4)
        for g in rest:
            g.grads_for_step()
            self._unpublished.add(id(g))
        self.stepper.submit(rest, None, hyper=settings)

    def _step(self, factors: StepFactors) -> None:
        if self._early_step:  # handed over in `_before_inner_step`
            self._early_step = False
            return
        self._unpublished = {id(g) for g in self.groups}
        if self.swapper is not None:
            self.swapper.evict_materialized()  # inspected or loaded state goes back to its files
        # unit order = forward order: the units needed first are stepped first
        self.stepper.submit(self.groups, factors.remaining)

    def _zero_grad(self) -> None:
        self.early.zero_grad()

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

    def _discard(self) -> None:
        for g in self.groups:
            g.settle_host_grad()  # a download still in flight must not land in the next window
        self.early.discard()

