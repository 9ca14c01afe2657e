"""`model.state_dict()` under stage 3: the full parameters, with every rank taking part.

[Note: full state dict under stage 3]
A stage-3 unit keeps only its shard between uses; its parameters keep their shapes over an empty
storage. Code that reads `model.state_dict()` - transformers' `save_pretrained` without
`state_dict=`, PEFT's adapter saving, `torch.save(model.state_dict())` - would then see empty
tensors (and transformers' tied-weight check fails on them). So the engine puts two documented
state-dict hooks on the model it shards:
- before the walk (`register_state_dict_pre_hook`), each sharded unit in turn is gathered, its
  parameters copied to the CPU in their own dtype (the values `forward` uses), and released again if
  it was released before: the GPU holds one gathered unit beyond its usual state at a time;
- after the walk (`register_state_dict_post_hook`), each parameter's entry is replaced by its copy.
Every rank gets the full tensors, so the call is collective: every rank must call `state_dict()`
(as `save_pretrained(..., is_main_process=...)` is called on every rank in Accelerate scripts); a
call on one rank alone waits for the others until the process-group timeout names it. Each rank
holds one full copy of the model in host memory until the caller drops the dict.
`state_dict(keep_vars=True)` asks for the parameters themselves and gets them, sharded, with no
gather: the engine's own checkpoint code reads names that way. Only the root module's `state_dict()`
gathers; a submodule's gives its local views.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerofit.engine.unit import ParamState, Unit


class FullStateDict:
    """The two state-dict hooks of a stage-3 model (see the note above)."""

    def __init__(self, model: nn.Module, units: list[Unit]):
        self.model = model
        self.units = [u for u in units if u.sharded]
        self._copies: dict[str, dict[int, torch.Tensor]] = {}
        """prefix -> id(parameter) -> its full CPU copy, between the pre- and the post-hook."""
        self._handles: list[Any] = []

    def install(self) -> None:
        # torch marks the hook objects it is given, which bound methods do not allow: plain functions.
        self._handles = [self.model.register_state_dict_pre_hook(lambda *a: self._before(*a)),
                         self.model.register_state_dict_post_hook(lambda *a: self._after(*a))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before(self, _module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars:
            self._copies[prefix] = self.gather_copies()

    def _after(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        copies = self._copies.pop(prefix, None)
        if copies is None:
            return
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if name in state_dict and id(p) in copies:
                state_dict[name] = copies[id(p)]

    def gather_copies(self) -> dict[int, torch.Tensor]:
        """Collective: id(parameter) -> a full CPU copy, for every parameter of a sharded unit."""
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for unit in self.units:
                released = unit.state is ParamState.RELEASED
                unit.wait_gathered()
                for g in unit.groups:
                    for p in g.params:
                        copies.setdefault(id(p), p.detach().to("cpu", copy=True))
                if released:
                    unit.release()
        return copies
