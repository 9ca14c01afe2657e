"""One chunk's worth of device buffers of the GPU-stepped stream (see [Note: GPU-stepped offload] in
zerofit.engine.offload.gpu), and the event that orders their reuse."""

from __future__ import annotations

import torch

from zerofit.engine import fused_kernels
from zerofit.engine.offload import master_split
from zerofit.engine.offload.gpu_runs import VECTOR


class Slot:
    """One chunk's worth of device buffers, and the events that order their reuse."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.free = None
        """Event: the last download from this slot is done (None: never used, or CPU)."""

    def buf(self, name: str, dtype: torch.dtype, n: int, shift: int = 0) -> torch.Tensor:
        """`n` elements of buffer `name`, starting `shift` elements in (see [Note: chunk alignment] in
        zerofit.engine.offload.gpu_runs)."""
        key = (name, dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self.capacity + VECTOR, dtype=dtype, device=self.device)
        return self._buffers[key][shift:shift + n]

    def packed(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the packed form of an `n`-element split master, the carries' scratch - None where the fused kernels
        split and join, which need none): uint8 buffers."""
        packed, carries = ("packed", torch.uint8), ("carries", torch.uint8)
        if packed not in self._buffers:
            cap = self.capacity
            self._buffers[packed] = torch.empty(master_split.packed_bytes(cap), dtype=torch.uint8, device=self.device)
            self._buffers[carries] = (None if fused_kernels.serves(self.device) else
                                      torch.empty(master_split.scratch_bytes(cap), dtype=torch.uint8,
                                                  device=self.device))
        return self._buffers[packed][:master_split.packed_bytes(n)], self._buffers[carries]
