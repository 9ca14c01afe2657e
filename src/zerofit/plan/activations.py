"""Activation memory of one training micro-step, measured by running it on fake tensors.

Architecture-agnostic and offline: the model (built by `zerofit.plan.sources`, no data) runs its
forward and backward on fake inputs of the planned batch, inside a dispatch mode that sees every
tensor an operator creates. Each storage is counted from its creation until its last tensor dies
(a weak reference per tensor), so the running total is what the CUDA caching allocator would hold
for activations, autograd's saved tensors, the logits and their fp32 copy for the loss, and the
gradients flowing backward - and its maximum is the activation peak. Parameters and their
gradients are not counted here: storages that exist before the step (parameters, buffers, the
inputs) are never counted, however an operator reaches them (`nn.Linear` saves its weight's
transpose, a view of the parameter, for backward: counting it charged Llama and BERT their weights
a second time, 7-17% over the measured peak); gradients are dropped as they arrive, as the engine
does after copying them into its flat buffers, and the buffers themselves are `zerofit.plan.memory`'s.

[Note: trace vs GPU]
The trace runs CPU kernels on fake tensors, so two things are made to match what the GPU runs:
- attention: CPU SDPA with dropout takes the unfused math path (s x s probabilities in fp32), the
  GPU a fused kernel that saves only its output and log-sum-exp. The trace turns attention dropout
  off (config keys named like `attn_pdrop`, `attention_dropout`) so the CPU takes its fused kernel too.
- dropout masks: the CPU keeps them in the input's dtype, the GPU's fused dropout as booleans; a
  storage filled by `bernoulli_` is counted at one byte per element.
The remaining difference (allocator rounding to 512 bytes, cuBLAS workspaces) is small and is
what `benchmarks/estimate_check.py` measures.

[Note: gradient buffers on the timeline]
Where the engine holds a unit's full fp32 gradient only while it is reduced (stages 2-3 on several
ranks, and optimizer offload), that buffer's lifetime depends on when backward reaches the unit.
The trace records, next to the running total, when each unit's first gradient arrives and when its
last one does; `ActivationTrace.peak` replays the engine's rule (allocated at the first gradient,
handed to a reduction at the last, at most `MAX_INFLIGHT_REDUCTIONS` reductions in flight) on that
timeline.

[Note: gathered parameters on the timeline]
Under stage 3 a sharded unit's parameters are whole on the GPU only around its use. The trace also
records when each unit's forward starts and ends and when backward reaches its outputs, and `peak`
replays the engine's gather rule (`zerofit.engine.stage3`) on them: gathered at its forward, with the
next unit of the forward order prefetched (the first unit already when the step starts); released when
its forward ends; gathered again, with the previous unit prefetched, when backward reaches it;
released when its last gradient arrives. Recomputation under activation checkpointing gathers nothing
new (the unit is already gathered for its backward). So an activation peak at the loss, where no
layer is gathered, is not charged two layers' parameters.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerofit.engine.engine import MAX_INFLIGHT_REDUCTIONS
from zerofit.engine.find_units import plan_units
from zerofit.engine.stage3 import tensors_in
from zerofit.plan.sources import ATTENTION_DROPOUT_KEYS, FakeModel

_FIRST, _LAST, _FORWARD, _FORWARD_END, _BACKWARD = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class ActivationTrace:
    """The running activation total of one forward + backward, with the units' gradient events."""

    forward_end_bytes: int
    """Held when forward returned: everything saved for backward, the outputs and the loss."""
    peak_bytes: int
    """Maximum of the running total (no engine gradient buffers)."""
    timeline: tuple[tuple[int, int, int], ...]
    """(running bytes, event, unit): event 0 = a change of the total, 1 = unit's first gradient, 2 = its last,
    3 = its forward starts, 4 = its forward ends, 5 = backward reaches its outputs."""
    units: int

    def peak(self, unit_grad_bytes: list[int] | None = None) -> int:
        """The peak with the engine's transient per-unit gradient buffers (`unit_grad_bytes[u]` each) added."""
        return self.peak_parts(unit_grad_bytes)[0]

    def peak_parts(self, unit_grad_bytes: list[int] | None = None,
                   gathered_bytes: list[int] | None = None) -> tuple[int, int]:
        """(peak, gathered parameter bytes at that peak): the running total with the transient gradient
        buffers and, where `gathered_bytes[u]` is given (stage 3's sharded units), the gathered parameters
        added on the engine's schedules (see the module notes)."""
        for sizes in (unit_grad_bytes, gathered_bytes):
            if sizes and len(sizes) != self.units:
                raise ValueError(f"{len(sizes)} unit sizes for a trace of {self.units} units: plan both with "
                                 "the same unit_size_threshold")
        grads = unit_grad_bytes if unit_grad_bytes and any(unit_grad_bytes) else None
        params = gathered_bytes if gathered_bytes and any(gathered_bytes) else None
        if grads is None and params is None:
            return self.peak_bytes, 0
        order = list(dict.fromkeys(u for _, event, u in self.timeline if event == _FORWARD))
        position = {u: i for i, u in enumerate(order)}
        extra, best, best_gathered = 0, 0, 0
        held: set[int] = set()
        inflight: deque[int] = deque()
        gathered: set[int] = set()

        def gather(*units: int | None) -> None:
            if params:
                gathered.update(u for u in units if u is not None)

        def neighbour(u: int, step: int) -> int | None:
            """The unit `step` places from `u` in the forward order (None past either end)."""
            if u not in position:
                return None
            i = position[u] + step
            return order[i] if 0 <= i < len(order) else None

        gather(order[0] if order else None)
        for total, event, unit in self.timeline:
            if grads and event == _FIRST and unit not in held:
                held.add(unit)
                extra += grads[unit]
            elif event == _LAST:
                if grads:
                    inflight.append(unit)
                    while len(inflight) > MAX_INFLIGHT_REDUCTIONS:
                        extra -= grads[inflight.popleft()]
                gathered.discard(unit)
            elif event == _FORWARD:
                gather(unit, neighbour(unit, +1))
            elif event == _FORWARD_END:
                gathered.discard(unit)
            elif event == _BACKWARD:
                gather(unit, neighbour(unit, -1))
            in_params = sum(params[u] for u in gathered) if params else 0
            if total + extra + in_params > best:
                best, best_gathered = total + extra + in_params, in_params
        return best, best_gathered


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage created inside the mode while a tensor still refers to it."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.total = 0
        self.peak = 0
        self.timeline: list[tuple[int, int, int]] = []
        self.masks: set[int] = set()
        self.outside: set[int] = set()
        """Storages that existed before the step (parameters, buffers, inputs): never activations."""

    def exclude(self, tensors) -> None:
        """Storages not to count, however an operator reaches them (a weight's transpose for `mm` is a
        view of the parameter's own storage, and autograd saves it: it is not a new tensor)."""
        self.outside.update(t.untyped_storage()._cdata for t in tensors)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.total -= self.sizes.pop(key)
            self.timeline.append((self.total, 0, -1))

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself, whichever view or wrapper reaches it
        if key in self.outside:
            return
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = storage.nbytes()
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.total)
            self.timeline.append((self.total, 0, -1))
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _as_mask(self, t: torch.Tensor) -> None:
        """A dropout mask: one byte per element on the GPU (see [Note: trace vs GPU])."""
        key = t.untyped_storage()._cdata
        if key in self.sizes and t.element_size() > 1 and key not in self.masks:
            self.masks.add(key)
            shrink = self.sizes[key] - t.numel()
            self.sizes[key] -= shrink
            self.total -= shrink
            self.timeline.append((self.total, 0, -1))

    def event(self, kind: int, unit: int) -> None:
        self.timeline.append((self.total, kind, unit))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen: set[int] = set()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in seen and t.untyped_storage().nbytes() > 0:
                seen.add(id(t))
                self._track(t)
        if func.__name__.startswith("bernoulli") and isinstance(out, torch.Tensor):
            self._as_mask(out)
        return out


def _fake_inputs(fake: FakeModel, batch: int, seq: int) -> dict[str, torch.Tensor]:
    with fake.mode:
        if fake.vocab_size is None:
            raise ValueError(f"{fake.description}: the planner feeds token ids, and this model has no vocab_size")
        ids = torch.randint(0, fake.vocab_size, (batch, seq))
        if fake.num_labels is not None:
            return {"input_ids": ids, "labels": torch.randint(0, max(1, fake.num_labels), (batch,))}
        return {"input_ids": ids, "labels": ids}


def _loss_of(out) -> torch.Tensor:
    loss = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, (tuple, list)) else out
    if loss is None:
        raise ValueError("the model returned no loss for the planner's inputs (input_ids, labels)")
    return loss.float().mean() if loss.dim() else loss


def _prepare(model: nn.Module, checkpointing: bool) -> None:
    """Attention dropout off (see [Note: trace vs GPU]), activation checkpointing as asked, and the
    loss of integer class labels named outright: some heads (DeBERTa-v2) otherwise pick the labeled
    rows with `nonzero()`, a data-dependent shape fake tensors cannot have. The config is the
    replica's own copy (`zerofit.plan.sources`); the loss and its memory are the same."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "problem_type", "") is None and getattr(config, "num_labels", 1) > 1 \
            and "ForSequenceClassification" in type(model).__name__:
        config.problem_type = "single_label_classification"
    for m in model.modules():  # modules copy the config's rate at construction
        for key in ATTENTION_DROPOUT_KEYS:
            value = getattr(m, key, None)
            if isinstance(value, nn.Dropout):
                value.p = 0.0
            elif isinstance(value, float) and not isinstance(m, nn.Dropout):
                setattr(m, key, 0.0)
    switch = checkpointing_switch(model)
    if switch is None:
        if checkpointing:
            raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable(): activation "
                             "checkpointing can only be planned for transformers models")
        return
    on, off = switch
    if checkpointing:
        on()
    elif has_checkpointing(model):
        off()


def has_checkpointing(model: nn.Module) -> bool:
    """Activation checkpointing is on somewhere in `model` (as transformers marks it)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def checkpointing_switch(model: nn.Module):
    """(turn on, turn off) activation checkpointing of a transformers model, non-reentrant (what the
    planner traces and what zerofit turns on), or None for a model that has no such switch."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
        return (lambda: model.activation_checkpointing_enable(**kwargs)), model.activation_checkpointing_disable
    if hasattr(model, "gradient_checkpointing_enable"):
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        return (lambda: model.gradient_checkpointing_enable(**kwargs)), model.gradient_checkpointing_disable
    return None


def trace_step(fake: FakeModel, *, batch: int, seq: int, checkpointing: bool = False,
               unit_size_threshold: int = 10_000_000) -> ActivationTrace:
    """Run forward + backward of one micro-batch of `batch` x `seq` tokens on `fake`, counting bytes.

    `unit_size_threshold` must be the engine's (`zero.unit_size_threshold`): units are numbered as it carves them.
    """
    model = fake.model
    _prepare(model, checkpointing)
    specs = plan_units(model, size_threshold=unit_size_threshold)
    unit_of = {id(p): u for u, spec in enumerate(specs) for _, p in spec.params}
    waiting = [len(spec.params) for spec in specs]
    inputs = _fake_inputs(fake, batch, seq)
    counter = _LiveBytes()
    counter.exclude([*model.parameters(), *model.buffers(), *inputs.values()])

    def arrived(p: torch.Tensor) -> None:
        unit = unit_of.get(id(p))
        p.grad = None  # the engine copies it into its flat buffer and drops it
        if unit is None:
            return
        if waiting[unit] == len(specs[unit].params):
            counter.event(_FIRST, unit)
        waiting[unit] -= 1
        if waiting[unit] == 0:
            counter.event(_LAST, unit)

    in_backward = False

    def forward_starts(unit: int) -> None:
        if not in_backward:  # recomputation under checkpointing: the unit is gathered for its backward
            counter.event(_FORWARD, unit)

    def forward_ends(unit: int, output) -> None:
        if in_backward:
            return
        counter.event(_FORWARD_END, unit)
        needs_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needs_grad:
            register_multi_grad_hook(needs_grad, lambda _g, u=unit: counter.event(_BACKWARD, u), mode="any")

    handles = [p.register_post_accumulate_grad_hook(arrived) for p in model.parameters() if p.requires_grad]
    for u, spec in enumerate(specs[1:], start=1):  # the root unit is gathered for the whole step
        handles.append(spec.module.register_forward_pre_hook(lambda _m, _a, u=u: forward_starts(u)))
        handles.append(spec.module.register_forward_hook(lambda _m, _a, out, u=u: forward_ends(u, out)))
    try:
        with fake.mode, counter:
            loss = _loss_of(model(**inputs))
            forward_end = counter.total
            in_backward = True
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    for unit, left in enumerate(waiting):  # units backward never finished reduce at its end
        if 0 < left < len(specs[unit].params):
            counter.event(_LAST, unit)
    return ActivationTrace(forward_end_bytes=forward_end, peak_bytes=counter.peak,
                           timeline=tuple(counter.timeline), units=len(specs))
