"""`WholeStep`: the step of a per-parameter optimizer's groups, each parameter whole on one rank.

[Note: whole-parameter steps]
An optimizer that reads a parameter's shape (Adafactor, Muon; see [Note: elementwise and per-parameter
optimizers] in zerofit.engine.optimizer_kinds) must see every parameter whole. Its parameters sit in
flat groups of their own (`FlatGroup.whole`), sharded like any other - masters, gradients and, at stage
3, parameters stay 1/world per rank between steps - and each parameter has one owner rank, chosen once
by size (largest first, to the least loaded rank), which alone keeps its optimizer state. `step()`, per
such group:
  1. all-gather the gradient shards and the fp32 master shards into full flat buffers (transient,
     one group at a time);
  2. the owner steps each of its parameters whole: a tensor of the parameter's shape over the full
     master, with its full gradient, through an optimizer of the script's class sharing its state;
  3. every rank writes the parameters it owns into a zeroed buffer and the buffers are summed
     (all-reduce): each element is its owner's value plus zeros, exactly; every rank copies its
     shard back into its master, then the group is published as usual.
Where the group is not sharded (stage 0, one rank, a unit kept whole at stage 3) every rank steps
every parameter of it from its own full buffers, with no communication, as DDP would.
The update is the unsharded one bit for bit on the owner (the same kernel on the same shape). The
cost over an elementwise step: two all-gathers and one all-reduce of the group's fp32 elements, and
full-size transient buffers of one group; the optimizer state is 1/world per rank, by whole parameters.
The state is kept on the device: these groups are never offloaded (`policy.state_homes` is bypassed).

The optimizer keys its state by tensor; each owned parameter is stood for by one persistent tensor of
its shape (`stand_in`, one element expanded: no memory) that sits in the script's param group and is
pointed at the full buffers for the step only (`.data`), then back.
"""

from __future__ import annotations

import torch

from zerofit.engine.comm import Collectives
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.optim import sub_optimizer, sync_hyperparams
from zerofit.engine.step_mode import StepFactors, StepMode, WrappingStep, publish

STAND_IN = "_zerofit_whole"
"""Attribute naming the parameter a stand-in tensor holds the place of (checkpoint code skips them)."""


def is_stand_in(t: torch.Tensor) -> bool:
    return hasattr(t, STAND_IN)


def owners(groups: list[FlatGroup], world: int) -> dict[tuple[int, int], int]:
    """(group position, parameter index) -> owner rank, for the sharded groups: the largest parameter first,
    each to the rank with the fewest elements so far (ties: the lowest rank). The same on every rank."""
    sizes = [((gi, i), n) for gi, g in enumerate(groups) if g.placement.shard_world > 1
             for i, n in enumerate(g.layout.numels)]
    sizes.sort(key=lambda item: (-item[1], item[0]))
    load = [0] * world
    out = {}
    for key, n in sizes:
        rank = min(range(world), key=lambda r: (load[r], r))
        out[key] = rank
        load[rank] += n
    return out


class WholeStep(WrappingStep):
    """Steps `groups` (each parameter whole, see [Note: whole-parameter steps]) after `inner` steps the rest."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], inner: StepMode,
                 comm: Collectives, device: torch.device):
        super().__init__(optimizer, inner)
        self.groups = groups
        self.comm = comm
        self.device = device
        owner = owners(groups, comm.world)
        self.owned: list[tuple[FlatGroup, int, torch.Tensor]] = []
        """(group, parameter index, stand-in) for every parameter this rank steps."""
        for gi, g in enumerate(groups):
            for i, shape in enumerate(g.shapes):
                if owner.get((gi, i), comm.rank) != comm.rank:
                    continue
                stand_in = self._resting(shape)
                setattr(stand_in, STAND_IN, g.names[i])
                optimizer.param_groups[g.layout.groups[i]]["params"].append(stand_in)
                self.owned.append((g, i, stand_in))
        self._sub, self._index = sub_optimizer(optimizer, [t for *_, t in self.owned], match=id)

    def _resting(self, shape: torch.Size) -> torch.Tensor:
        """A tensor of `shape` holding no memory: a stand-in between steps."""
        return torch.zeros((), dtype=torch.float32, device=self.device).expand(shape)

    def named_stand_ins(self) -> dict[str, torch.Tensor]:
        """Parameter name -> its stand-in, for the parameters this rank steps (their optimizer state's keys)."""
        return {g.names[i]: t for g, i, t in self.owned}

    def _step(self, factors: StepFactors) -> None:
        if self._sub is not None:
            sync_hyperparams(self._sub, self._index, self.optimizer)
        for g in self.groups:
            self._step_group(g, factors.remaining)
        publish(self.groups, self.comm)

    def _step_group(self, g: FlatGroup, remaining) -> None:
        sharded = g.placement.shard_world > 1
        grad_shard = g.grad_shard.float() if g.grad_shard.dtype != torch.float32 else g.grad_shard
        if sharded:
            full_grad = torch.empty(g.layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full_grad, grad_shard.to(self.device).contiguous(), f"whole_grad:{g.unit_name}").wait()
            full_master = torch.empty(g.layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full_master, g.master.to(self.device).contiguous(),
                                 f"whole_master:{g.unit_name}").wait()
        else:
            full_grad, full_master = grad_shard, g.master
        if remaining is not None and not (isinstance(remaining, float) and remaining == 1.0):
            full_grad = full_grad * (remaining.to(full_grad.device) if isinstance(remaining, torch.Tensor)
                                     else remaining)
        mine = [(i, t) for gg, i, t in self.owned if gg is g]
        with torch.no_grad():
            for i, t in mine:
                off, n = g.layout.offsets[i], g.layout.numels[i]
                t.data = full_master[off:off + n].view(g.shapes[i])
                t.grad = None if i in g.unused else full_grad[off:off + n].view(g.shapes[i])
        try:
            if mine:
                self._sub.step()
        finally:
            for i, t in mine:
                t.grad = None
                t.data = self._resting(g.shapes[i])
        if not sharded:
            return
        with torch.no_grad():
            out = torch.zeros_like(full_master)
            for i, _ in mine:
                off, n = g.layout.offsets[i], g.layout.numels[i]
                out[off:off + n] = full_master[off:off + n]
            self.comm.all_reduce_now(out, f"whole_scatter:{g.unit_name}")
            lo, hi = g.layout.shard_range(g.placement.rank)
            g.master.copy_(out[lo:hi])
        del full_grad, full_master, out
