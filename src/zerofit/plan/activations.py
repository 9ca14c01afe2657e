"""Activation memory of one training micro-step, measured by running it on fake tensors.

Architecture-agnostic and offline: the model (built by `zerofit.plan.sources`, no data) runs its
forward and backward on fake inputs of the planned batch, inside a dispatch mode that sees every
tensor an operator creates. Each storage is counted from its creation until its last tensor dies
(a weak reference per tensor), so the running total is what the CUDA caching allocator would hold
for activations, autograd's saved tensors, the logits and their fp32 copy for the loss, and the
gradients flowing backward - and its maximum is the activation peak. Parameters and their
gradients are not counted here: gradients are dropped as they arrive, as the engine does after
copying them into its flat buffers, and the buffers themselves are `zerofit.plan.memory`'s.

[Note: trace vs GPU]
The trace runs CPU kernels on fake tensors, so two things are made to match what the GPU runs:
- attention: CPU SDPA with dropout takes the unfused math path (s x s probabilities in fp32), the
  GPU a fused kernel that saves only its output and log-sum-exp. The trace turns attention dropout
  off (config keys named like `attn_pdrop`, `attention_dropout`) so the CPU takes its fused kernel too.
- dropout masks: the CPU keeps them in the input's dtype, the GPU's fused dropout as booleans; a
  storage filled by `bernoulli_` is counted at one byte per element.
The remaining difference (allocator rounding to 512 bytes, cuBLAS workspaces) is small and is
what `bench/estimate_check.py` measures.

[Note: gradient buffers on the timeline]
Where the engine holds a unit's full fp32 gradient only while it is reduced (stages 2-3 on several
ranks, and optimizer offload), that buffer's lifetime depends on when backward reaches the unit.
The trace records, next to the running total, when each unit's first gradient arrives and when its
last one does; `ActivationTrace.peak` replays the engine's rule (allocated at the first gradient,
handed to a reduction at the last, at most `MAX_INFLIGHT_REDUCTIONS` reductions in flight) on that
timeline.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerofit.engine.engine import MAX_INFLIGHT_REDUCTIONS
from zerofit.engine.units import plan_units
from zerofit.plan.sources import ATTENTION_DROPOUT_KEYS, FakeModel

_FIRST, _LAST = 1, 2


@dataclass(frozen=True)
class ActivationTrace:
    """The running activation total of one forward + backward, with the units' gradient events."""

    forward_end_bytes: int
    """Held when forward returned: everything saved for backward, the outputs and the loss."""
    peak_bytes: int
    """Maximum of the running total (no engine gradient buffers)."""
    timeline: tuple[tuple[int, int, int], ...]
    """(running bytes, event, unit): event 0 = a change of the total, 1 = unit's first gradient, 2 = its last."""
    units: int

    def peak(self, unit_grad_bytes: list[int] | None = None) -> int:
        """The peak with the engine's transient per-unit gradient buffers (`unit_grad_bytes[u]` each) added."""
        if not unit_grad_bytes:
            return self.peak_bytes
        if len(unit_grad_bytes) != self.units:
            raise ValueError(f"{len(unit_grad_bytes)} unit sizes for a trace of {self.units} units: plan both with "
                             "the same unit_size_threshold")
        extra, best, live = 0, 0, 0
        held: set[int] = set()
        inflight: deque[int] = deque()
        for total, event, unit in self.timeline:
            live = total
            if event == _FIRST and unit not in held:
                held.add(unit)
                extra += unit_grad_bytes[unit]
            elif event == _LAST:
                inflight.append(unit)
                while len(inflight) > MAX_INFLIGHT_REDUCTIONS:
                    extra -= unit_grad_bytes[inflight.popleft()]
            best = max(best, live + extra)
        return best


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

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.total -= self.sizes.pop(key)
            self.timeline.append((self.total, 0, -1))

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself, whichever view or wrapper reaches it
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
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        on, off, kwargs = model.activation_checkpointing_enable, model.activation_checkpointing_disable, \
            {"activation_checkpointing_kwargs": {"use_reentrant": False}}
    elif hasattr(model, "gradient_checkpointing_enable"):
        on, off, kwargs = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable, \
            {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    elif checkpointing:
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable(): activation "
                         "checkpointing can only be planned for transformers models")
    else:
        return
    if checkpointing:
        on(**kwargs)
    elif any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        off()


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

    handles = [p.register_post_accumulate_grad_hook(arrived) for p in model.parameters() if p.requires_grad]
    try:
        with fake.mode, counter:
            loss = _loss_of(model(**inputs))
            forward_end = counter.total
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
