"""Stage 3: gather each unit just before its forward and its backward, release it right after.

Hooks are the documented module forward pre/post hooks and `register_multi_grad_hook` on a unit's
outputs, which fires before any of the unit's backward runs (the root's too: several forwards may
precede their backwards, and each backward releases every unit). The unit's post-backward release happens
when its last gradient has arrived (see `ZeroEngine._on_grad`); units whose gradients never arrive
(frozen, unused) are released when `ZeroEngine.backward` returns.

[Note: prefetch order]
Each forward records the order in which units ran. The next forward prefetches, on entering a unit,
the unit that followed it last time; backward prefetches the one that preceded it. The first
iteration has no record and simply gathers on demand. A changed order costs only a missed prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook

from zerofit.engine.unit import Unit


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts (including ModelOutput) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors_in(item)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in tensors_in(getattr(obj, name, None))]
    return []


class Stage3Hooks:
    """Installs the gather/release hooks on every sharded unit and prefetches along the recorded order."""

    def __init__(self, root: Unit, units: list[Unit], in_backward: Callable[[], bool]):
        self.root = root
        self.units = units
        self._in_backward = in_backward
        self._order: list[Unit] = []
        self._last_order: list[Unit] = []
        self._handles = []

    def install(self) -> None:
        self._handles.append(self.root.module.register_forward_pre_hook(self._root_pre))
        self._handles.append(self.root.module.register_forward_hook(self._root_post))
        if self.root.sharded:
            # Submodules may be called without the root's forward (generate() runs the encoder of an
            # encoder-decoder model directly): the modules holding root parameters gather them too.
            root_ids = {id(p) for g in self.root.groups for p in g.params}
            for m in self.root.module.modules():
                if m is not self.root.module and any(id(p) in root_ids for p in m.parameters(recurse=False)):
                    self._handles.append(m.register_forward_pre_hook(lambda *_a: self.root.wait_gathered()))
        for unit in self.units:
            if unit is self.root or not unit.sharded:
                continue
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda _m, _a, u=unit: self._pre_forward(u)))
            self._handles.append(unit.module.register_forward_hook(
                lambda _m, _a, out, u=unit: self._post_forward(u, out)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _neighbour(order: list[Unit], unit: Unit, step: int) -> Unit | None:
        try:
            i = order.index(unit) + step
        except ValueError:
            return None
        return order[i] if 0 <= i < len(order) else None

    def _root_pre(self, _module, _args) -> None:
        if self._in_backward():
            return  # recomputation inside backward: the record of the real forward stays
        if self._order:
            self._last_order = self._order
        self._order = []
        self.root.wait_gathered()
        if self._last_order:
            self._last_order[0].gather()

    def _root_post(self, _module, _args, out) -> None:
        if not torch.is_grad_enabled():
            for unit in self.units:  # no backward will follow (evaluation, generation)
                unit.release()
            return
        needs_grad = [t for t in tensors_in(out) if t.requires_grad]
        if self.root.sharded and needs_grad and not self._in_backward():
            # The root stays gathered from its forward to the end of the next backward; a script that runs
            # several forwards before their backwards needs it again for the later ones.
            register_multi_grad_hook(needs_grad, lambda _grad: self.root.wait_gathered(), mode="any")

    def _pre_forward(self, unit: Unit) -> None:
        if not self._in_backward() and unit not in self._order:
            self._order.append(unit)
        unit.wait_gathered()
        nxt = self._neighbour(self._last_order, unit, +1)
        if nxt is not None and not self._in_backward():
            nxt.gather()

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if self._in_backward():
            return  # activation recomputation: the unit is needed right now by its backward
        needs_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needs_grad:
            register_multi_grad_hook(needs_grad, lambda _grad, u=unit: self._pre_backward(u), mode="any")
        unit.release()

    def _pre_backward(self, unit: Unit) -> None:
        unit.wait_gathered()
        prev = self._neighbour(self._order, unit, -1)  # backward runs this forward's order in reverse
        if prev is not None:
            prev.gather()
