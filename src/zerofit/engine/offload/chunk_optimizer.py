"""`ChunkOptimizers`: the one-tensor optimizers the GPU-stepped stream steps each chunk with (see [Note: GPU-stepped
offload] in zerofit.engine.offload.gpu), and each chunk's copies of its pieces' scalar state."""

from __future__ import annotations

import torch

from zerofit.engine.optim import member_of_group

_FUSED_ON_CUDA = ("Adam", "AdamW", "SGD")  # optimizer classes whose fused kernels exist on CUDA


class ChunkOptimizers:
    """Per param group of the script's `optimizer`, an optimizer of its class, re-pointed at each chunk's pieces."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = device
        self._cuda = device.type == "cuda"
        self._held: dict[int, tuple[torch.optim.Optimizer, dict]] = {}
        """Per param group: its optimizer and the settings it was last given."""

    def get(self, index: int, settings: dict) -> torch.optim.Optimizer:
        """The one-tensor optimizer of param group `index`, with this step's `settings` of that group."""
        held = self._held.get(index)
        if held is not None and held[1] is settings:
            return held[0]  # this step's settings were given for an earlier run of the group
        given = dict(settings)
        cls = type(member_of_group(self.optimizer, index))  # several optimizers: the group's own
        if self._cuda and given.get("fused") and cls.__name__ not in _FUSED_ON_CUDA:
            given["fused"] = None  # a CPU-only fused kernel: the default implementation on the device
        if held is None:
            placeholder = torch.zeros(1, device=self.device)
            opt = cls([{**given, "params": [placeholder]}], lr=given.get("lr", 1e-3))
        else:
            opt = held[0]
        opt.param_groups[0].update(given)
        self._held[index] = (opt, settings)
        return opt

    def scalar_copies(self, scalars: list[tuple[dict, str, object]], opt: torch.optim.Optimizer) -> None:
        """Give each part of a chunk its own copy of its piece's scalar state (`given[key] = copy` for each
        (given, key, value)). The 0-dim tensors under one key (Adam's `step`) are copied by one stack, then
        split into views, one per part: one kernel for the chunk instead of one per piece, the same values."""
        by_key: dict[str, list[tuple[dict, object]]] = {}
        for given, k, v in scalars:
            by_key.setdefault(k, []).append((given, v))
        for k, items in by_key.items():
            first = items[0][1]
            if len(items) > 1 and isinstance(first, torch.Tensor) and all(
                    isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == first.dtype and v.device == first.device
                    for _, v in items):
                copies = self._copy(torch.stack([v for _, v in items]), opt, copied=True).unbind()
            else:
                copies = [self._copy(v, opt) for _, v in items]
            for (given, _), c in zip(items, copies):
                given[k] = c

    def _copy(self, value, opt: torch.optim.Optimizer, *, copied: bool = False):
        """A chunk's own copy of a piece's scalar state, where the chunk's kernel wants it (`copied`: `value` is
        a copy already, only moved if need be)."""
        if not isinstance(value, torch.Tensor):
            return value
        group = opt.param_groups[0]
        if self._cuda and (group.get("fused") or group.get("capturable")) and value.device.type == "cpu":
            return value.to(self.device)  # once after a checkpoint load; the piece keeps the device copy
        return value if copied else value.clone()  # a copy: `to` returns the tensor itself when it is there already
