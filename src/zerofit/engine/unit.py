"""A communication unit at run time and its three verbs: gather, release, reduce.

The stage policy decides what each verb does (see `zerofit.engine.policy`); the unit only knows its
flat groups and how to move them through `Collectives`.

[Note: gradients on the wire]
With several ranks a unit's gradients are summed over the ranks in `precision.communication_data_type`
(DeepSpeed's `communication_data_type`; `Collectives.grad_dtype`). fp32, the default, sends the fp32
buffers backward accumulated into as they are. bf16 or fp16 send half the bytes: just before the
collective the unit casts its full fp32 gradient to that dtype (one 16-bit copy of the unit's gradient,
released when the reduction is waited; at stages 2-3 the transient fp32 buffer goes at once, so a
reduction in flight holds half the bytes it holds in fp32), the ranks sum in it, and this rank's summed
shard is upcast to fp32 and only then divided by the world size, into its fp32 gradient shard. So only
the sum over ranks is rounded; accumulation over micro-steps and the optimizer's input stay fp32.

Why divide after the upcast rather than before the cast (`prescale_gradients`): for bf16, which has
fp32's exponent range, the two agree exactly for a power-of-two world, and for 3 ranks the division
after the upcast came out slightly closer to the exact mean (relative error 2.84e-3 against 2.86-2.89e-3
over gradients of magnitude 1e-7 to 3e4, gloo). For fp16, dividing first pushes small unscaled
gradients below fp16's range, silently (relative error 34-52 % against 17 % at magnitude 1e-7), while
the overflow of a sum that dividing first would avoid shows up as inf, which the fp16 loss scaler
turns into a skipped step and a smaller scale. One rank sends nothing: the setting changes nothing there.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from zerofit.engine.comm import Collectives, Pending
from zerofit.engine.flat_group import FlatGroup


class ParamState(enum.Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """A module whose parameters travel together, held as one or two flat groups."""

    def __init__(self, name: str, module: nn.Module, groups: list[FlatGroup], comm: Collectives):
        self.name = name or "<root>"
        self.module = module
        self.groups = groups
        self.trainable = [g for g in groups if g.trainable]
        self.comm = comm
        self.sharded = any(g.placement.shard_params for g in groups)
        self.state = ParamState.RELEASED if self.sharded else ParamState.GATHERED
        self._gathers: list[Pending] = []
        self.reported: list[set[int]] = [set() for _ in self.trainable]
        """Per trainable group: parameters whose gradient this backward delivered."""
        self.used: list[set[int]] = [set() for _ in self.trainable]
        """Per trainable group: parameters that got a gradient on this rank in this accumulation window."""
        self.reduced = False
        """Gradients of this backward have been handed to a reduction."""
        self.passed = False
        """This backward went past the unit: no gradient may arrive any more (see [Note: one gather order])."""
        self.backward_pass = 0
        """Counts `begin_backward` calls: a forward call's input-gradient signal from an earlier backward is stale."""
        self.awaiting_inputs = 0
        """Forward calls whose backward began in this backward and whose input gradient is not computed yet
        (see [Note: a unit's backward is done] in zerofit.engine.stage3)."""
        self.before_use = None
        """Called before the parameters are gathered or used (waits for an overlapped host step)."""
        self.keeps_after_backward: Callable[[Unit], bool] | None = None
        """Asked when backward is done with the unit: True keeps it gathered for the update and the next forward
        ([Note: handover] in zerofit.engine.offload.handover)."""

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    # --- gather / release (stage 3) -------------------------------------------------------------
    def gather(self) -> None:
        """Start gathering the full parameters (returns at once; `wait_gathered` before use)."""
        if self.state is not ParamState.RELEASED:
            return
        if self.before_use is not None:
            self.before_use()
        for g in self.groups:
            if g.placement.shard_params:
                g.alloc_full()
                self._gathers.append(self.comm.all_gather(g.param_flat, g.param_shard, self.name))
                g.gathered = True
        self.state = ParamState.GATHERING

    def wait_gathered(self) -> None:
        if self.state is ParamState.RELEASED:
            self.gather()
        if self.state is ParamState.GATHERING:
            for p in self._gathers:
                p.wait()
            self._gathers.clear()
            self.state = ParamState.GATHERED

    def release(self) -> None:
        if not self.sharded or self.state is ParamState.RELEASED:
            return
        self.wait_gathered()  # never free memory a gather is still writing into
        for g in self.groups:
            g.release()
        self.state = ParamState.RELEASED

    def release_after_backward(self) -> None:
        """Backward is done with the unit: release it, unless it is kept for the update and the next forward."""
        if self.keeps_after_backward is None or self.state is not ParamState.GATHERED \
                or not self.keeps_after_backward(self):
            self.release()

    # --- gradients ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        for s in self.reported:
            s.clear()
        self.reduced = False
        self.passed = False
        self.backward_pass += 1
        self.awaiting_inputs = 0

    def on_grad(self, group: int, index: int, grad: torch.Tensor, *, factor: float = 1.0) -> bool:
        """Take one parameter's gradient (times `factor`); True once every trainable parameter has reported."""
        self.trainable[group].accumulate(index, grad, factor=factor)
        self.reported[group].add(index)
        self.used[group].add(index)
        return self.all_reported

    def pass_over(self) -> None:
        """Backward went past this unit: its parameters without a gradient get none in this backward."""
        self.passed = True

    @property
    def complete(self) -> bool:
        """Every trainable parameter's gradient of this backward has arrived, or backward went past the unit."""
        return self.passed or self.all_reported

    @property
    def all_reported(self) -> bool:
        """Every trainable parameter got a gradient in this backward."""
        return all(len(s) == len(g.params) for s, g in zip(self.reported, self.trainable))

    @property
    def backward_done(self) -> bool:
        """Nothing left in this backward needs the parameters: every trainable gradient has arrived and the
        gradient w.r.t. the inputs of every forward call it backpropagated through exists."""
        return self.complete and self.awaiting_inputs == 0

    def has_new_grads(self) -> bool:
        return any(self.reported)

    def new_window(self) -> None:
        """The accumulation window's gradients were zeroed: no parameter has been used in the next one yet."""
        for s in self.used:
            s.clear()

    def reduce(self, *, sync: bool) -> list[Pending]:
        """Hand this unit's gradients to the reduction the policy wants now (maybe none)."""
        self.reduced = True
        out: list[Pending] = []
        world = self.comm.world
        for g in self.trainable:
            pl = g.placement
            if pl.host_stepped:
                out.extend(self._reduce_to_host(g))
                continue
            if world == 1:
                continue  # grad_flat is grad_shard: backward already accumulated in place
            if pl.shard_world == 1:
                if sync:  # stage 0: replicas agree on the mean gradient once per optimizer step
                    out.append(self._all_reduce_mean(g.grad_shard))
            elif pl.keep_full_grads:
                if sync:  # stage 1: one reduce-scatter per optimizer step
                    shard = g.grad_shard
                    if self.comm.grad_dtype == torch.float32:  # the sum lands in the shard itself
                        out.append(self.comm.reduce_scatter(shard, g.grad_flat, self.name,
                                                            then=lambda s=shard: s.div_(world)))
                    else:
                        out.append(self._reduce_scatter_mean(g, shard.copy_))
            else:  # stages 2-3: keep only the shard, every micro-step (every rank, got it gradients or not)
                out.append(self._reduce_scatter_mean(g, g.grad_shard.add_))
        return out

    def _reduce_to_host(self, g: FlatGroup) -> list[Pending]:
        """Offloaded optimizer: reduce this micro-step's gradients and send the shard to the host now."""
        world = self.comm.world
        if g.grad_flat is None and world == 1:
            return []
        if world == 1:
            full = g.grad_flat_or_zeros()
            g.drop_grad_flat()
            return [self.comm.reduce_scatter(full, full, self.name, then=lambda f=full: g.take_reduced_grad(f))]
        return [self._reduce_scatter_mean(g, g.take_reduced_grad)]  # every rank takes part, got it gradients or not

    def _reduce_scatter_mean(self, g: FlatGroup, take: Callable[[torch.Tensor], object]) -> Pending:
        """Reduce-scatter `g`'s full gradient (several ranks) and hand `take` this rank's shard of the mean, fp32.

        A transient full gradient is the reduction's from here on (stage 1's persists); in a 16-bit
        communication dtype only its cast copy travels (see [Note: gradients on the wire]).
        """
        world, wire = self.comm.world, self.comm.grad_dtype
        full = g.grad_flat_or_zeros()
        g.drop_grad_flat()
        if wire != full.dtype:
            full = full.to(wire)
        part = torch.empty(g.layout.shard_numel, dtype=full.dtype, device=full.device)
        return self.comm.reduce_scatter(part, full, self.name, then=lambda: take(_mean(part, world)))

    def _all_reduce_mean(self, full: torch.Tensor) -> Pending:
        """Stage 0: `full` (a replica's fp32 gradient) becomes the mean over the ranks, in place."""
        world, wire = self.comm.world, self.comm.grad_dtype
        if wire == full.dtype:
            return self.comm.all_reduce(full, self.name, then=lambda: full.div_(world))
        low = full.to(wire)  # [Note: gradients on the wire]
        return self.comm.all_reduce(low, self.name, then=lambda: full.copy_(low).div_(world))


def _mean(summed: torch.Tensor, world: int) -> torch.Tensor:
    """The fp32 mean from a shard summed over `world` ranks: upcast first (no copy when it is fp32), then
    divide (see [Note: gradients on the wire])."""
    return summed.float().div_(world)
