"""`OptimizerSet`: the several optimizers a script built over one model, seen by the engine as one.

[Note: several optimizers over one model]
torch documents Muon beside AdamW: `Muon(matrices)` and `AdamW(everything else)`, two optimizers over
disjoint parameters of one model. The engine steps one optimizer object (see [Note: one optimizer
object] in zerofit.engine.optim); `OptimizerSet` is that object for several. Its `param_groups` are the
members' own group dicts, in member order, so rebinding a group to its master pieces rebinds it in the
member (and an LR scheduler built on a member keeps setting that member's `lr`); its `state` reads and
writes each tensor's state in the member that steps the tensor, so a member's own `state_dict()` still
holds exactly its parameters; `step()` steps every member. The engine applies one accumulation window
to all of them at once: the gradient norm, clipping and the fp16 overflow check cover the whole model,
as `accelerator.clip_grad_norm_(model.parameters())` does under DDP.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


class _RoutedState(MutableMapping):
    """tensor -> state dict, kept in the member optimizer whose param groups hold the tensor."""

    def __init__(self, owner: OptimizerSet):
        self._set = owner

    def _member(self, t: torch.Tensor) -> torch.optim.Optimizer:
        member = self._set.member_of(t)
        if member is None:
            raise KeyError(f"a tensor of shape {tuple(t.shape)} is in no member optimizer's param groups")
        return member

    def __getitem__(self, t):
        member = self._member(t)
        if t not in member.state and not isinstance(member.state, defaultdict):
            raise KeyError(t)
        return member.state[t]

    def __setitem__(self, t, value) -> None:
        self._member(t).state[t] = value

    def __delitem__(self, t) -> None:
        del self._member(t).state[t]

    def __contains__(self, t) -> bool:
        member = self._set.member_of(t) if isinstance(t, torch.Tensor) else None
        return member is not None and t in member.state

    def get(self, t, default=None):
        return self[t] if t in self else default

    def __iter__(self) -> Iterator:
        for m in self._set.members:
            yield from m.state

    def __len__(self) -> int:
        return sum(len(m.state) for m in self._set.members)


class OptimizerSet(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters of one model, stepped together (see the module note).

    Like `AcceleratedOptimizer` it never calls `Optimizer.__init__`: it owns no groups, state or defaults.
    """

    def __init__(self, members: list[torch.optim.Optimizer]):
        self.members = list(members)
        self._state = _RoutedState(self)
        self._found: dict[int, tuple[weakref.ref, torch.optim.Optimizer]] = {}
        """id(tensor) -> (a weak reference to it, its member): lookups of state by tensor stay O(1)."""

    def member_of(self, t: torch.Tensor) -> torch.optim.Optimizer | None:
        """The member whose param groups hold `t` (by identity), or None."""
        hit = self._found.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        for m in self.members:
            for g in m.param_groups:
                if any(p is t for p in g["params"]):
                    self._found[id(t)] = (weakref.ref(t), m)
                    return m
        return None

    def member_of_group(self, index: int) -> torch.optim.Optimizer:
        """The member owning `param_groups[index]`."""
        for m in self.members:
            if index < len(m.param_groups):
                return m
            index -= len(m.param_groups)
        raise IndexError(index)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for m in self.members for g in m.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("an OptimizerSet's param groups are its members': set them on each member")

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.members[0].defaults

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        """Assigning a fresh mapping gives every member a fresh state of its own (what rebinding does)."""
        if len(value):
            raise ValueError("an OptimizerSet's state can only be reset (assign an empty mapping)")
        for m in self.members:
            m.state = defaultdict(dict)

    def step(self, closure: Any = None) -> None:
        for m in self.members:
            m.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return "OptimizerSet(" + ", ".join(type(m).__name__ for m in self.members) + ")"


def members_of(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The real optimizers behind `optimizer`: its members for a set, else itself (none for None)."""
    if optimizer is None:
        return []
    return list(optimizer.members) if isinstance(optimizer, OptimizerSet) else [optimizer]
