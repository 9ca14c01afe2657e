"""`OffloadPart`: what every offloaded way of stepping shares, written once.

[Note: offload parts]
An offload part steps its own trainable groups (`groups`: their optimizer state lives off the
device) and wraps `inner`, the step mode of every other group: the device's `PlainStep` or
`CompactStep`, or another part (the host-stepped part wraps the GPU-stepped one when both are used).
This base owns what each part would otherwise wire by hand, the same way for every part:
- the hooks of [Note: step modes] in zerofit.engine.step_mode, through `WrappingStep` there: each runs
  `inner`'s hook first, then the part's own (`_begin_backward`, `_reduced`, ...); hooks that answer
  combine both answers. `step` runs `_before_inner_step`, `inner.step`, then `_step`;
- before use: a unit holding one of the part's groups waits for them before forward uses it - its
  `before_use` (stage 3's gathers, `state_dict`) and a forward pre-hook registered before the stage-3
  hooks, so a unit is stepped before it is gathered - publishing the groups of the units before it
  first (`publish_bounds`, [Note: one collective order] in zerofit.engine.engine); the part says per
  group how (`_await_group`);
- before read: host readers of the groups' state (checkpoints, `local_fragments`) settle the part
  first (`FlatGroup.before_read`, set by `_settle_before_read`);
- the NVMe swapper of the part's groups (`_nvme_swapper`), and the finalizer that stops the part's
  thread and removes its NVMe files when the part is collected or the process exits (`close`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from zerofit.config.schema import AioConfig, OffloadConfig
from zerofit.engine.comm import Collectives, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.early import EarlyStart
from zerofit.engine.offload.nvme import NvmeSwapper
from zerofit.engine.stage3 import opaque
from zerofit.engine.state_codec import Codec
from zerofit.engine.step_mode import StepMode, WrappingStep, publish_bounds
from zerofit.engine.timing import StepTimes
from zerofit.engine.unit import Unit


class OffloadPart(WrappingStep):
    """The offloaded step of `groups` around `inner`, the step of the others (see [Note: offload parts])."""

    forward_communicates = True  # a unit's first use after a step publishes its groups (all-gathers, stages 1-2)

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], inner: StepMode, *,
                 model: nn.Module, units: list[Unit], comm: Collectives, times: StepTimes):
        super().__init__(optimizer, inner)
        self.groups = groups
        self.units = units
        self.comm = comm
        self.times = times
        self.early = EarlyStart("not supported by this part", "offloaded optimizer steps")
        """When this part's updates may start during backward (the part sets its own; see [Note: updates during
        backward] in zerofit.engine.offload.early)."""
        self._early_step = False
        """This step's window started during backward (`_begin_step` until the part's `_step`)."""
        self.swapper: NvmeSwapper | None = None
        """The groups' NVMe files, when their state lives there (set by the part: see `_nvme_swapper`)."""
        self.close: Callable[[], None] = lambda: None
        """Stop the part's thread and remove its NVMe files now (idempotent; see `_close_with_self`)."""
        self._upto = publish_bounds(units, groups)
        """Per unit: how many of `groups` belong to it or to units before it (published before it is used)."""
        self._hooks = self._wire_before_use(model, units)

    # --- wiring, once for every part --------------------------------------------------------------
    def _wire_before_use(self, model: nn.Module, units: list[Unit]) -> list:
        mine = {id(g) for g in self.groups}
        hooks = []
        for unit in units:
            if any(id(g) in mine for g in unit.trainable):
                unit.before_use = partial(self._await, unit)
                target = model if unit is units[0] else unit.module
                # registered before the stage-3 hooks, so a unit is stepped before it is gathered; opaque to
                # torch.compile: see [Note: hooks under torch.compile] in zerofit.engine.stage3
                hooks.append(target.register_forward_pre_hook(opaque(lambda *_a, u=unit: self._await(u))))
        return hooks

    def _nvme_swapper(self, offload: OffloadConfig | None, aio: AioConfig | None,
                      codec: Codec | None = None) -> NvmeSwapper | None:
        """The swapper of the groups' files under `offload.device` "nvme", else None (`codec`: the form the state
        is stored in there). Built once the groups' optimizer pieces were matched (by address): swapping out
        empties the tensors."""
        if offload is None or offload.device != "nvme":
            return None
        return NvmeSwapper(self.groups, self.optimizer, offload, aio or AioConfig(), self.comm, self.comm.device,
                           codec)

    def reader(self):
        """What lets host readers take the groups one at a time (`one_at_a_time`, `holds`, `readable`; see
        `ZeroEngine.state_by_group`): the NVMe swapper, or None when every group is readable as it is."""
        return self.swapper

    def _settle_before_read(self, settle: Callable[[], None]) -> None:
        """Host readers of the groups' state call `settle` first. One object for every group:
        `local_fragments` calls each distinct hook once."""
        for g in self.groups:
            g.before_read = settle

    def _close_with_self(self, close: Callable[..., None], *args) -> None:
        """Run `close(*args)` when this part is collected, at exit, or at `self.close()`. `close` and `args`
        must not hold the part: its worker thread would keep it alive."""
        self.close = weakref.finalize(self, close, *args)

    # --- the part's own hooks that differ from `WrappingStep`'s defaults --------------------------------
    def _begin_step(self) -> bool:
        self._early_step = self.early.begin_step()
        return self._early_step

    def _update_started(self) -> bool:
        return bool(self.early.started)  # handed over during backward: masters may be updated

    def _settle(self, *, state: bool) -> None:
        self._await_all()

    # --- before use ------------------------------------------------------------------------------
    def _await_group(self, g: FlatGroup) -> Pending | None:
        """The main stream waits for `g`'s update; returns the all-gather of its parameters, if any
        (collectives stay on the main thread, in unit order)."""
        raise NotImplementedError

    def _nothing_pending(self) -> bool:
        """No group is waiting to be published (a fast path; False: look at each group)."""
        return False

    def _await_groups(self, groups: list[FlatGroup]) -> None:
        if self._nothing_pending():
            return
        for g in groups:
            gather = self._await_group(g)
            if gather is not None:
                gather.wait()

    def _await(self, unit: Unit) -> None:
        """Before `unit` is used: wait for its groups' updates and publish their parameters - and those of
        every unit before it first, so every rank publishes in unit order whichever units its forward
        skips (see [Note: one collective order] in zerofit.engine.engine)."""
        self.early.used()
        self._await_groups(self.groups[:self._upto[id(unit)]])

    def _await_all(self) -> None:
        self._await_groups(self.groups)
