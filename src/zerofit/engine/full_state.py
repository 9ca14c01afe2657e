"""`module.state_dict()` under stage 3: the full parameters, with every rank taking part.

[Note: full state dict under stage 3]
A stage-3 unit keeps only its shard between uses; its parameters keep their shapes over an empty
storage. Code that reads `model.state_dict()` - transformers' `save_pretrained` without
`state_dict=`, PEFT's adapter saving, `torch.save(model.state_dict())`, or the same on a submodule,
`model.lm_head.state_dict()` - would then see empty tensors (and transformers' tied-weight check
fails on them). So the engine puts two documented state-dict hooks on every module of the model it
shards, the root and each submodule alike:
- before the walk (`register_state_dict_pre_hook`), each sharded unit holding a parameter of the
  module asked is gathered in turn, its parameters copied to the CPU in their own dtype (the values
  `forward` uses) on the main process (rank 0), and released again if it was released before: the
  GPU holds one gathered unit beyond its usual state at a time;
- after the walk (`register_state_dict_post_hook`), each parameter's entry is replaced by its copy on
  the main process, and by a tensor on the meta device of the same shape and dtype on the others.
Only the outermost call of a walk gathers: `state_dict()` recurses into the children, whose hooks
see an open walk whose prefix theirs extends and leave the entries to it.
Only the main process keeps full tensors, so saving a model needs one host copy of it, not one per
rank (8 ranks x a 13 B model in bf16 would be 208 GB); the others get placeholders that key filters
(PEFT's) and `save_pretrained(..., is_main_process=False)` pass through, and that fail loudly if
written. One exception, [Note: adapters everywhere]: when the trainable parameters are an adapter on
a frozen base - a PEFT model's (its `peft_config` names the adapters), or any model's trainable part of at
most ADAPTER_SHARE of its elements - every rank gets full copies of the trainable ones. PEFT's
`model.save_pretrained(dir)` writes the adapter from every rank by default (`is_main_process=True`), as
PEFT's own example scripts call it (CorDA's `corda_finetuning.py` under Trainer; `peft_no_lora_accelerate.py`
with `state_dict=accelerator.get_state_dict(model)`), and crashed on the placeholders; the adapter is
small, so a copy per rank costs little, and every rank writes the same values. A PEFT model is told by
its config, not its share: p-tuning's prompt encoder (an MLP of `encoder_hidden_size`, 128 by default)
on a small base is over half its elements. (Under DeepSpeed those ranks get None from Accelerate's
`get_state_dict`, and PEFT reads `model.state_dict()` instead, where every partitioned parameter is empty:
their files race with rank 0's. Here every rank writes the same bytes.)
Every rank takes part in the gathers, so the call is collective: every rank must call `state_dict()`
on the same module (as `save_pretrained(..., is_main_process=...)` is called on every
rank in Accelerate scripts). Before the first gather each rank says so in the run's store and waits
for the others: a call on one rank alone (`if accelerator.is_main_process: model.save_pretrained(...)`)
raises `RanksApartError` within seconds, there and on the ranks that went elsewhere, naming the cause
and the fix; a rank that is only late is waited for ([Note: checked places] in zerofit.distributed.arrival).
`state_dict(keep_vars=True)` asks for the parameters themselves and gets them, sharded, with no
gather: the engine's own checkpoint code reads names that way.

[Note: gathered parameters]
Between uses a stage-3 parameter has its shape over an empty storage, so code that reads or rewrites
weights outside a forward - PEFT's `merge_and_unload()` above all, which adds each adapter into its base
weight at the end of a LoRA run - fails inside torch ("its data is not allocated yet").
`Accelerator.gathered_parameters(model)` (`FullStateDict.held`) gathers every sharded unit on every rank
for a block, so such code sees, and may change, the full weights: merge, then `save_pretrained` inside
the block saves the merged model. At the block's end the units released before are released again: their
full values, whatever the block wrote, are dropped; the training state (the fp32 masters, the shards) is
as it was, so the block cannot move training on by accident (`model.load_state_dict` does that, on
purpose). The whole model is held on every rank at once: what the GPU must fit for this is the model in
its compute dtype beside the training state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zerofit.distributed import arrival
from zerofit.engine.unit import ParamState, Unit

ADAPTER_SHARE = 0.10
"""Trainable elements at most this share of the model's: the trainable part is an adapter, copied to every
rank in a saved state dict ([Note: adapters everywhere])."""


def adapter_sized(groups) -> bool:
    """The trainable parameters of these flat groups are a small part of them ([Note: adapters everywhere])."""
    trainable = sum(g.layout.padded_numel for g in groups if g.trainable)
    total = sum(g.layout.padded_numel for g in groups)
    return 0 < trainable <= ADAPTER_SHARE * total


def names_adapters(model: nn.Module, groups) -> bool:
    """`model` is a PEFT model with something to train: its trainable parameters are its adapters and the
    modules PEFT saves with them, whatever their share ([Note: adapters everywhere]). Told as transformers
    tells one (a `peft_config` dict and `get_base_model`), without importing PEFT."""
    configs = getattr(model, "peft_config", None)
    return (isinstance(configs, dict) and bool(configs) and callable(getattr(model, "get_base_model", None))
            and any(g.trainable for g in groups))


def inside_walk(open_walk: tuple[nn.Module, str, Any] | None, prefix: str) -> bool:
    """True for a child module's hook inside the walk `open_walk` serves (its prefix extends the walk's);
    a walk that raised never closes, so a fresh call with the walk's own prefix replaces it."""
    return open_walk is not None and len(prefix) > len(open_walk[1]) and prefix.startswith(open_walk[1])


class FullStateDict:
    """The two state-dict hooks of every module of a stage-3 model (see the note above)."""

    def __init__(self, model: nn.Module, units: list[Unit], *, is_main: bool):
        self.model = model
        self.is_main = is_main
        """This rank keeps the full copies (the others get meta placeholders)."""
        groups = [g for u in units for g in u.groups]
        self.adapter = names_adapters(model, groups) or adapter_sized(groups)
        """Every rank keeps full copies of the trainable parameters ([Note: adapters everywhere])."""
        self.units = [u for u in units if u.sharded]
        self._open: tuple[nn.Module, str, dict[int, torch.Tensor]] | None = None
        """The walk being served: (its outermost module, its prefix, id(parameter) -> full CPU copy)."""
        self._handles: list[Any] = []
        self.before_gather: Callable[[], None] = lambda: None
        """Called before a walk or a `held` block gathers: releases the units no-grad forwards kept
        ([Note: kept units] in zerofit.engine.kept), whose full copies a `held` block could rewrite."""

    def install(self) -> None:
        # torch marks the hook objects it is given, which bound methods do not allow: plain functions.
        for module in self.model.modules():
            self._handles += [module.register_state_dict_pre_hook(lambda *a: self._before(*a)),
                              module.register_state_dict_post_hook(lambda *a: self._after(*a))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        if inside_walk(self._open, prefix):
            return
        self._open = None
        self.before_gather()
        ids = {id(p) for p in module.parameters()}
        units = [u for u in self.units if any(id(p) in ids for g in u.groups for p in g.params)]
        self._open = (module, prefix, self.gather_copies(units, caller=type(module).__name__))

    def _after(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        if self._open is None or self._open[0] is not module or self._open[1] != prefix:
            return
        copies, self._open = self._open[2], None
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if name in state_dict and id(p) in copies:
                state_dict[name] = copies[id(p)]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Collective: every sharded unit gathered (the whole model on every rank) for the block; the units that
        were released before are released again at its end, and what the block wrote into their parameters goes
        with them (see [Note: gathered parameters])."""
        if self.units:  # collective from here: every rank must be here too ([Note: checked places])
            arrival.check_in(arrival.GATHERED_PARAMETERS)
        self.before_gather()
        released = []
        try:
            for unit in self.units:
                if unit.state is ParamState.RELEASED:
                    released.append(unit)
                unit.wait_gathered()
            yield
        finally:
            for unit in reversed(released):
                unit.release()

    def gather_copies(self, units: list[Unit] | None = None, *, caller: str = "model") -> dict[int, torch.Tensor]:
        """Collective: id(parameter) -> a full CPU copy on the main process, a meta tensor of the same shape
        and dtype elsewhere (an adapter's trainable parameters: a copy everywhere, [Note: adapters
        everywhere]), for every parameter of `units` (default: every sharded unit); the same units
        on every rank, in the engine's order. `caller` names the module asked, for the error of a rank
        left alone ([Note: checked places] in zerofit.distributed.arrival)."""
        units = self.units if units is None else units
        if units:  # collective from here: every rank must be here too ([Note: checked places])
            arrival.check_in(arrival.state_dict_place(caller))
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for unit in units:
                released = unit.state is ParamState.RELEASED
                with arrival.notice_if_alone(caller):  # the check off: one unit's gather takes seconds at most
                    unit.wait_gathered()
                    for g in unit.groups:
                        for p in g.params:
                            if id(p) not in copies:
                                keep = self.is_main or (self.adapter and g.trainable)
                                copies[id(p)] = (p.detach().to("cpu", copy=True) if keep
                                                 else torch.empty(p.shape, dtype=p.dtype, device="meta"))
                if released:
                    unit.release()
        return copies
