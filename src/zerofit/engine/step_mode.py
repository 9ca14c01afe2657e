"""How the optimizer step runs: one `StepMode` object per way of stepping, chosen once by the engine.

[Note: step modes]
`ZeroEngine` runs the same phases in every setting - backward and reductions, unscale and clip,
overflow check, optimizer step, publish - and asks its step mode at fixed points what to do:
- `PlainStep`: the optimizer steps the device shards in `step()`, from fp32 gradients;
- `CompactStep`: gradients kept in the compute dtype, each group stepped from an fp32 upcast (see
  [Note: compact gradients]); a second backward in one window makes it step as its `PlainStep`;
- the offload parts (zerofit.engine.offload): `HostStep` steps its groups on a CPU thread (host-
  stepped), overlapped with the next forward and, when the step's factor is known early, with
  backward itself; `GpuStep` streams its groups' state from host memory through the GPU and steps
  it there (GPU-stepped). Each wraps the mode of the other groups - `HostStep` around `GpuStep`
  around a `PlainStep` or `CompactStep` of the groups left on the device - and forwards every hook
  to it first (see [Note: offload parts] in zerofit.engine.offload.part).
A mode owns its flags; the engine never asks which mode it has. Another way of stepping is another
subclass (of `OffloadPart`, if it wraps the others), with the same hooks.

The hooks, in the order the engine calls them over one accumulation window:
  begin_backward -> reduced (per unit, as its reductions launch) -> end_backward   (each micro-step)
  clip_requested (if the script clips) -> prepare_grads (before the norm) -> begin_step -> step
  zero_grad (after every step, and whenever the window's gradients are zeroed)
and at any time: settle (before anything reads state), discard (the window is thrown away), widen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.engine.comm import Collectives, Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.optim import (
    bind_grads,
    folds_grad_scale,
    mark_stepped,
    master_pieces,
    step_with_factor,
    sub_optimizer,
    sync_hyperparams,
    unused_pieces,
    without_grads,
)
from zerofit.engine.unit import Unit


@dataclass(frozen=True)
class StepFactors:
    """What `step()` applies to this window's gradients (all None: exactly 1)."""

    norm: torch.Tensor | None = None
    """The global gradient norm after unscaling, when it was measured."""
    whole: torch.Tensor | float | None = None
    """The whole unscale/clip factor (compact gradients take it as they are upcast)."""
    remaining: torch.Tensor | float | None = None
    """What is still to apply to fp32 gradients: folded into the fused optimizer kernels, else None
    (the gradients were scaled in place already)."""


class StepMode:
    """The engine's hooks for one way of stepping (see [Note: step modes]); by default they do nothing."""

    forward_communicates = False
    """This mode runs collectives in forward (parameters published as their unit is first used)."""

    @property
    def update_started(self) -> bool:
        """Part of this window's update has run already (during backward), so the window cannot be replayed."""
        return False

    @property
    def compact(self) -> bool:
        """The gradients of the groups stepped on the device are in the compute dtype (until widened)."""
        return False

    def begin_backward(self, sync: bool) -> None:
        """One micro-step's backward starts; `sync`: it closes the accumulation window."""

    def reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        """`unit`'s gradient reductions were just launched (during backward, or right after it)."""

    def end_backward(self) -> None:
        """Every unit of this backward was reduced and released."""

    def clip_requested(self, max_norm: float) -> torch.Tensor | None:
        """`clip_grad_norm_` was called: the norm when this window's update already ran, else None."""
        return None

    def prepare_grads(self) -> None:
        """Before the gradient norm: every gradient shard must hold this window's values."""

    def begin_step(self) -> bool:
        """`step()` starts: True when this window's update began during backward (its factor is 1)."""
        return False

    def step(self, factors: StepFactors) -> None:
        """Update the masters from the gradients and publish them into the compute-dtype parameters."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """The window's gradients were zeroed: the next backward starts a new window."""

    def settle(self, *, state: bool = False) -> None:
        """Finish overlapped work so parameters and gradients are readable (`state`: masters and
        optimizer state too)."""

    def discard(self) -> None:
        """The window is thrown away (out-of-memory back-off): nothing in flight may reach the next one."""

    def widen(self) -> None:
        """Keep every gradient in fp32 from now on (see [Note: compact gradients])."""


class PlainStep(StepMode):
    """The optimizer steps `groups` on the device in `step()`, from fp32 gradients, then publishes them."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, groups: list[FlatGroup], comm: Collectives,
                 *, settings_of: torch.optim.Optimizer | None = None, index: list[int] | None = None):
        """`optimizer` None: nothing to step. A sub-optimizer (`part_of`) reads lr & co. from
        `settings_of` before each step (`index`: the param group each of its groups mirrors)."""
        self.optimizer = optimizer
        self.groups = groups
        self.comm = comm
        self._settings_of = settings_of
        self._index = index or []

    @classmethod
    def part_of(cls, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], comm: Collectives) -> PlainStep:
        """The step of some of `optimizer`'s groups alone, through a smaller optimizer sharing its state."""
        pieces = [t for g in groups for t in master_pieces(g)]
        sub, index = sub_optimizer(optimizer, pieces) if pieces else (None, [])
        return cls(sub, groups, comm, settings_of=optimizer, index=index)

    def step(self, factors: StepFactors) -> None:
        if self.optimizer is not None:
            if self._settings_of is not None:
                sync_hyperparams(self.optimizer, self._index, self._settings_of)
            with without_grads([t for g in self.groups for t in unused_pieces(g)]):
                step_with_factor(self.optimizer, factors.remaining)
        publish(self.groups, self.comm)


class CompactStep(StepMode):
    """The step of groups whose gradients are kept in the compute dtype; `wide` steps them once widened.

    [Note: compact gradients]
    On one rank with no accumulation (and no offload), each parameter's gradient reaches the engine
    once per step, already in the compute dtype (bf16/fp16): an fp32 buffer would only hold the same
    values in twice the bytes. Such groups keep `grad_shard` in the compute dtype - 2 bytes per
    parameter instead of 4, what DeepSpeed's ZeRO-2 keeps - and each is stepped alone: its gradient
    upcast to a transient fp32 buffer (one group at a time), bound to its master pieces, stepped by
    a small optimizer of the script's class sharing its state, unbound. Same update, bit for bit.
    A second backward before `step()` (accumulation turned on later, e.g. by the out-of-memory
    back-off) would round a sum in the compute dtype: the groups are widened to fp32 first
    (`FlatGroup.widen`) and stepped by `wide` from then on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, wide: PlainStep):
        self.optimizer = optimizer
        self.wide = wide
        self._subs: list | None = [(g, *sub_optimizer(optimizer, master_pieces(g))) for g in wide.groups if g.compact]
        """(group, sub-optimizer, index) per compact group; None once widened."""
        self._backward_ran = False
        """A backward ran since the last step or zero_grad (a second one widens the gradients)."""

    @property
    def compact(self) -> bool:
        return self._subs is not None

    def begin_backward(self, sync: bool) -> None:
        if self._backward_ran:
            self.widen()
        self._backward_ran = True

    def zero_grad(self) -> None:
        self._backward_ran = False

    def widen(self) -> None:
        if self._subs is None:
            return
        for g, _, _ in self._subs:
            g.widen()
            bind_grads(self.optimizer, g, g.grad_shard)
        self._subs = None

    def step(self, factors: StepFactors) -> None:
        if self._subs is None:
            self.wide.step(factors)
            return
        factor = factors.whole
        folded = folds_grad_scale(self.optimizer)
        for g, sub, index in self._subs:
            if sub is None:
                continue
            grad = g.grad_shard.float()
            if isinstance(factor, torch.Tensor) and not folded:
                grad.mul_(factor.to(grad.device))
            elif factor is not None and factor != 1.0 and not folded:
                grad.mul_(factor)
            sync_hyperparams(sub, index, self.optimizer)
            bind_grads(sub, g, grad)
            try:
                with without_grads(unused_pieces(g)):
                    step_with_factor(sub, factor if folded else None)
            finally:
                bind_grads(sub, g, None)
        mark_stepped(self.optimizer)
        publish(self.wide.groups, self.wide.comm)


class WrappingStep(StepMode):
    """A step mode of some groups around `inner`, the mode of the others: every hook runs `inner`'s first, then
    the wrapper's own (`_begin_backward`, `_reduced`, ...: no-ops unless a wrapper has work there); hooks that
    answer combine both answers; `step` runs `_before_inner_step`, `inner.step`, then `_step`. The offload parts
    (zerofit.engine.offload.part) and the whole-parameter step (zerofit.engine.whole_step) are such wrappers."""

    def __init__(self, optimizer: torch.optim.Optimizer, inner: StepMode):
        self.optimizer = optimizer
        self.inner = inner

    @property
    def forward_communicates(self) -> bool:  # type: ignore[override]
        return self.inner.forward_communicates

    @property
    def compact(self) -> bool:
        return self.inner.compact or self._compact()

    @property
    def update_started(self) -> bool:
        return self.inner.update_started or self._update_started()

    def begin_backward(self, sync: bool) -> None:
        self.inner.begin_backward(sync)
        self._begin_backward(sync)

    def reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        self.inner.reduced(unit, pendings)
        self._reduced(unit, pendings)

    def end_backward(self) -> None:
        self.inner.end_backward()
        self._end_backward()

    def clip_requested(self, max_norm: float) -> torch.Tensor | None:
        inner = self.inner.clip_requested(max_norm)
        own = self._clip_requested(max_norm)
        return own if own is not None else inner

    def prepare_grads(self) -> None:
        self.inner.prepare_grads()
        self._prepare_grads()

    def begin_step(self) -> bool:
        inner = self.inner.begin_step()
        own = self._begin_step()
        return inner or own

    def step(self, factors: StepFactors) -> None:
        self._before_inner_step(factors)
        self.inner.step(factors)
        mark_stepped(self.optimizer)
        self._step(factors)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self._zero_grad()

    def settle(self, *, state: bool = False) -> None:
        self.inner.settle(state=state)
        self._settle(state=state)

    def discard(self) -> None:
        self.inner.discard()
        self._discard()

    def widen(self) -> None:
        self.inner.widen()
        self._widen()

    # --- the wrapper's own hooks (by default nothing) -----------------------------------------------
    def _compact(self) -> bool:
        """Some of the wrapper's own groups keep compact gradients."""
        return False

    def _update_started(self) -> bool:
        return False

    def _begin_backward(self, sync: bool) -> None:
        pass

    def _reduced(self, unit: Unit, pendings: list[Pending]) -> None:
        pass

    def _end_backward(self) -> None:
        pass

    def _clip_requested(self, max_norm: float) -> torch.Tensor | None:
        return None

    def _prepare_grads(self) -> None:
        pass

    def _begin_step(self) -> bool:
        return False

    def _before_inner_step(self, factors: StepFactors) -> None:
        """Work already decided before this step (a window whose update began during backward) is handed
        over before the inner mode steps."""

    def _step(self, factors: StepFactors) -> None:
        """Step (or hand over) the wrapper's own groups, after the inner mode stepped its groups."""
        raise NotImplementedError

    def _zero_grad(self) -> None:
        pass

    def _settle(self, *, state: bool) -> None:
        pass

    def _discard(self) -> None:
        pass

    def _widen(self) -> None:
        pass


def gather_params(g: FlatGroup, comm: Collectives) -> Pending | None:
    """All-gather `g`'s updated shard into its full parameters where they stay replicated (stages 1-2)."""
    if g.placement.shard_world > 1 and not g.placement.shard_params:
        lo, hi = g.layout.shard_range(g.placement.rank)
        return comm.all_gather(g.param_flat, g.param_flat[lo:hi], f"publish:{g.unit_name}")
    return None


def publish(groups: list[FlatGroup], comm: Collectives, *, masters: bool = True) -> None:
    """Masters -> compute-dtype parameters of `groups`, all-gathered where replicated (in group order);
    `masters` False: the shards were published from the masters already, only gather them."""
    gathers = []
    for g in groups:
        if masters:
            g.publish_master()
        pending = gather_params(g, comm)
        if pending is not None:
            gathers.append(pending)
    for p in gathers:
        p.wait()


def publish_bounds(units: list[Unit], groups: list[FlatGroup]) -> dict[int, int]:
    """id(unit) -> how many of `groups` (in unit order) belong to that unit or to units before it: an
    offload mode that publishes parameters as units are first used publishes that prefix, in order, so
    every rank issues the same all-gathers whichever units its forward skips (see [Note: one collective
    order] in zerofit.engine.engine)."""
    owner = {id(g): i for i, u in enumerate(units) for g in u.groups}
    return {id(u): sum(owner[id(g)] <= i for g in groups) for i, u in enumerate(units)}
