"""Stage 3: gather each unit just before its forward and its backward, release it right after.

Hooks are the documented module forward pre/post hooks, `register_multi_grad_hook` on a unit's
outputs, which fires before any of the unit's backward runs (the root's too: several forwards may
precede their backwards, and each backward releases every unit), and an identity autograd function on
a unit's inputs, whose backward runs once the gradient w.r.t. those inputs exists. The unit is
released after its backward when that is done (see [Note: a unit's backward is done]); units whose
backward never ends that way (a trainable parameter without a gradient, an unused unit) are released
when the engine's backward ends (`ZeroEngine.backward` returns, or autograd ends a backward the engine
did not start: see zerofit.engine.plain_backward).

[Note: prefetch order]
Each forward records the order in which units ran (`GatherOrder`: one schedule for training forwards,
which with several ranks also keeps every rank's gathers in one order, see [Note: one gather order];
one for forwards without gradients). The next forward of the same kind
prefetches, on entering a unit, the unit that followed it last time; backward prefetches the one that
preceded it. The first forward has no record and gathers on demand. A changed order costs only a
missed prefetch.

[Note: a unit's backward is done]
A unit's parameters are needed until its backward has computed both the gradients of its trainable
parameters and the gradient w.r.t. its forward inputs - which runs through its frozen weights. The
two come in no fixed order: in a LoRA linear (x @ W^T + (x @ A^T) @ B^T * s, W frozen) autograd
delivers A's and B's gradients before the gradient w.r.t. x has gone through W. So:
- each forward call whose inputs require grad passes them through `_InputGradSignal`, an identity
  whose backward runs once the gradient w.r.t. them exists (the sum over all their uses in the unit);
- the call's pre-backward hook (on its outputs) counts it as awaited in this backward
  (`Unit.awaiting_inputs`), the signal uncounts it; a call whose backward never starts in this
  backward (several forwards before their backwards) is not awaited;
- the unit is released when the last of these events leaves `Unit.backward_done` true: the last
  trainable gradient (`ZeroEngine._on_grad`) or the last awaited input gradient (`_input_grads_done`).
A frozen unit (no trainable parameters) is thus released as soon as its input gradient exists, so
LoRA on a big frozen model keeps two units gathered, not the model. A unit run twice in one forward
is released after both calls' backwards when it trains; a frozen one may be released between them
and gathered again by the earlier call's pre-backward. Under reentrant activation checkpointing the
recomputed forward's outputs and inputs get the same hooks and the nested backward runs them; a
non-reentrant recomputation's graph is never backpropagated, so its calls are never awaited.
The rule misses a gradient that leaves the unit through a tensor that is neither an input (an
argument, or inside a tuple, list or dict argument) nor a trainable parameter of its own, e.g. one
hidden in an object: if such a path still needs the unit's frozen weights after the rule released
them, backward fails with a storage of size 0.

[Note: hooks under torch.compile]
A compiled model (`model.compile()`, `torch.compile`) runs its module hooks inside dynamo's frame.
The engine's hooks are registered through `opaque`, `torch.compiler.disable`: dynamo breaks the graph
at each call and runs the hook eagerly instead of tracing into it. Traced, the hooks broke the graph
deeper anyway (collectives with `async_op`, storage resizing, `register_multi_grad_hook`), and their
resume frames guarded on which unit they served, so they recompiled per unit until dynamo's
recompile limit (8) sent them back to eager. The model's code between two hooks is compiled either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook

from zerofit.engine.gather_order import GatherOrder
from zerofit.engine.kept import KeptUnits
from zerofit.engine.unit import Unit


def opaque(hook: Callable) -> Callable:
    """`hook`, run eagerly when a compiled model calls it (see [Note: hooks under torch.compile])."""
    return torch.compiler.disable(hook, recursive=True)


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


class _Call:
    """One forward call of a unit whose inputs require grad; `awaited_in` is the backward pass (see
    `Unit.backward_pass`) that waits for its input gradient, None when none does."""

    __slots__ = ("unit", "awaited_in")

    def __init__(self, unit: Unit):
        self.unit = unit
        self.awaited_in: int | None = None


class _InputGradSignal(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradient exists: the unit's backward is
    done with them (see [Note: a unit's backward is done])."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor):
        ctx.call = call
        ctx.set_materialize_grads(False)
        # Aliases, not the inputs themselves nor views: autograd forbids modifying a custom function's
        # view output in place, and a module may update its input in place as it could without us.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        _input_grads_done(ctx.call)
        return (None, *grads)


def _input_grads_done(call: _Call) -> None:
    unit = call.unit
    if call.awaited_in != unit.backward_pass:
        return  # its outputs got no gradient first in this backward: nobody counted it
    call.awaited_in = None
    unit.awaiting_inputs -= 1
    if unit.backward_done:
        unit.release_after_backward()


def _plain_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside `obj` through plain tuples, lists and dicts: those `_map_tensors` can replace."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list):
        return [t for item in obj for t in _plain_tensors(item)]
    if type(obj) is dict:
        return [t for item in obj.values() for t in _plain_tensors(item)]
    return []


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with `fn` applied to every tensor in it, through plain tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (tuple, list):
        return type(obj)(_map_tensors(item, fn) for item in obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class Stage3Hooks:
    """Installs the gather/release hooks on every sharded unit and prefetches along the recorded order."""

    def __init__(self, root: Unit, units: list[Unit], in_backward: Callable[[], bool],
                 pass_over: Callable[[Unit], None], notice_backward: Callable[[], None] = lambda: None):
        """`notice_backward()`: a pre-backward hook fired, so a backward the engine did not start is open
        from now on (see [Note: a backward the engine did not start] in zerofit.engine.plain_backward)."""
        self.root = root
        self.units = units
        self._in_backward = in_backward
        self._notice_backward = notice_backward
        self._open: dict[Unit, _Call | None] = {}
        """Per unit: its forward call under way (between the pre and the post forward hook)."""
        self.hooked = [u for u in units if u is not root and (u.sharded or u.trainable)]
        """Units with forward hooks: the sharded ones, and the trainable ones kept whole, whose reductions
        the schedule places too (see [Note: one gather order])."""
        self.order = GatherOrder(self.hooked, ordered=root.comm.world > 1, pass_over=pass_over)
        self.kept = KeptUnits(root.comm)
        """Units no-grad forwards leave gathered (see [Note: kept units] in zerofit.engine.kept)."""
        self._root_with_grad = False
        """The root's forward under way records autograd: units its no-grad parts run (a reentrant
        activation checkpoint) are not kept."""
        self._handles = []

    def install(self) -> None:
        self._handles.append(self.root.module.register_forward_pre_hook(opaque(self._root_pre)))
        self._handles.append(self.root.module.register_forward_hook(opaque(self._root_post)))
        if self.root.sharded:
            # Submodules may be called without the root's forward (generate() runs the encoder of an
            # encoder-decoder model directly): the modules holding root parameters gather them too.
            root_ids = {id(p) for g in self.root.groups for p in g.params}
            for m in self.root.module.modules():
                if m is not self.root.module and any(id(p) in root_ids for p in m.parameters(recurse=False)):
                    self._handles.append(m.register_forward_pre_hook(opaque(lambda *_a: self.root.wait_gathered())))
        for unit in self.hooked:
            self._handles.append(unit.module.register_forward_pre_hook(
                opaque(lambda _m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs)), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                opaque(lambda _m, _a, out, u=unit: self._post_forward(u, out))))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _root_pre(self, _module, _args) -> None:
        if self._in_backward():
            return  # recomputation inside backward: the record of the real forward stays
        with_grad = self._root_with_grad = torch.is_grad_enabled()
        if with_grad:
            self.kept.release()  # training needs the room: [Note: kept units]
        else:
            self.kept.begin()
        self.order.begin_forward(with_grad=with_grad)
        self.root.wait_gathered()
        if not with_grad:
            self.kept.admit(self.root)  # first: embeddings and head are used at every token
        first = self.order.first()
        if first is not None:
            first.gather()

    def _root_post(self, _module, _args, out) -> None:
        if not self._in_backward():
            self.order.end_forward(with_grad=torch.is_grad_enabled())
            self._root_with_grad = False
        if not torch.is_grad_enabled():
            for unit in self.units:  # no backward will follow (evaluation, generation): kept units stay
                if not self.kept.holds(unit):
                    unit.release()
            return
        needs_grad = [t for t in tensors_in(out) if t.requires_grad]
        if self.root.sharded and needs_grad and not self._in_backward():
            # The root stays gathered from its forward to the end of the next backward; a script that runs
            # several forwards before their backwards needs it again for the later ones.
            register_multi_grad_hook(needs_grad, lambda _grad: self._root_pre_backward(), mode="any")

    def _root_pre_backward(self) -> None:
        self._notice_backward()
        self.root.wait_gathered()

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        nxt = None if self._in_backward() else self.order.enter(unit)
        unit.wait_gathered()
        if nxt is not None:
            nxt.gather()
        self._open[unit] = None
        if not torch.is_grad_enabled():
            return None
        inputs = {id(t): t for t in _plain_tensors((args, kwargs)) if t.requires_grad}
        if not inputs:
            return None
        call = self._open[unit] = _Call(unit)
        signalled = dict(zip(inputs, _InputGradSignal.apply(call, *inputs.values())))
        wrap = lambda t: signalled.get(id(t), t)  # noqa: E731
        return _map_tensors(args, wrap), _map_tensors(kwargs, wrap)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        call = self._open.pop(unit, None)
        needs_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needs_grad:
            # Also for a recomputation inside backward: a reentrant checkpoint backpropagates through it.
            register_multi_grad_hook(needs_grad, lambda _grad, u=unit, c=call: self._pre_backward(u, c), mode="any")
        if self._in_backward():
            return  # activation recomputation: the unit is needed right now by its backward
        if self._keeps(unit):
            return
        unit.release()

    def _keeps(self, unit: Unit) -> bool:
        """`unit` stays gathered after its forward: kept already, or a no-grad forward admits it."""
        if self.kept.holds(unit):
            return True
        return not torch.is_grad_enabled() and not self._root_with_grad and self.kept.admit(unit)

    def _pre_backward(self, unit: Unit, call: _Call | None) -> None:
        self._notice_backward()  # first: the backward's bookkeeping counts this call's awaited input
        if call is not None:
            call.awaited_in = unit.backward_pass
            unit.awaiting_inputs += 1
        prev = self.order.reach(unit)  # backward runs the last forward's order in reverse
        unit.wait_gathered()
        if prev is not None:
            prev.gather()
