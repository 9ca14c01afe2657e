"""Stage-3 units kept gathered from their backward through the GPU-stepped update into the next forward.

[Note: handover]
With stage 3 and parameter offload on one GPU, a GPU-stepped unit's 16-bit parameters cross the host link up
three times a step: for its forward, for its backward, and for the update (the split master is rebuilt against
them: [Note: split master] in zerofit.engine.offload.master_split; the new ones go down after). Backward ends
with the units the forward ran first, and by then the activations of every unit after them are gone: their
gathered parameters can stay in room backward has just freed. The update then rebuilds and splits the master
against them in place (no upload), writes the new parameters into them as well as down to the host shard, and
the next forward finds those units gathered (no upload either): 4 of the ~10.6 bytes per parameter uploaded a
step (GPT-2 XL's ZeRO-3 full offload with 8-bit state: 2 + 2 for the two gathers, 2 for the update's parameter,
2.125 for the split master, 2.5 for the state) for every unit kept; on one H100 that step went 0.485 -> 0.376 s
(on a tree with bf16 block scales: docs/benchmarks.md, session 20).

A unit is kept when backward is done with it (instead of released) if
- one rank trains (with several, the kept full parameters hold the other ranks' old shards after the update;
  the way there, not built: the kept unit's next gather all-gathers in place from its own shard on the device
  instead of uploading the host's - the same collective in the same order whatever each rank kept);
- every trainable group of it is GPU-stepped with offloaded parameters (a group stepped on the device or on the
  host publishes into the host shard only);
- this backward closes the window and its updates wait for `step()` (none starts during backward: [Note:
  updates during backward] in zerofit.engine.offload.early - such an update could be queued before the unit is
  kept, and write past it);
- the stream has stepped once (its slots exist), and the memory allocated now, plus the unit's parameters, plus
  those of the largest eligible unit (the gather backward prefetches next), stays under what was allocated when
  this backward began - the forward's activations were there: keeping a unit never raises the peak a step
  reaches.
The update's wait for the gradients covers backward's reads of the kept parameters; the next forward waits for
the unit's update as it waits for every GPU-stepped unit (`OffloadPart._await`), then uses and releases it as
usual. Paths that write parameters outside a step release every gathered unit (`ZeroEngine.refresh_params`),
as they must for any gathered unit. On a CPU device nothing is measured: units are kept only under
`CPU_BUDGET` (the tests' way to run these paths without a GPU).
"""

from __future__ import annotations

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.unit import Unit

CPU_BUDGET: int | None = None
"""Bytes of parameters a backward may keep gathered on a CPU device (None: none; tests set it)."""


class Handover:
    """Which units stay gathered from their backward to the next forward (see the note), for one `GpuStep`."""

    def __init__(self, units: list[Unit], groups: list[FlatGroup], device: torch.device, world: int):
        mine = {id(g) for g in groups if g.placement.gpu_stepped and g.placement.offload_params}
        self._eligible = {id(u): u for u in units
                          if world == 1 and u.trainable and all(id(g) in mine for g in u.trainable)}
        self._bytes = {key: sum(g.layout.padded_numel * g.param_flat.element_size()
                                for g in u.groups if g.placement.shard_params)
                       for key, u in self._eligible.items()}
        self._margin = max(self._bytes.values(), default=0)
        self._cuda = device.type == "cuda"
        self.device = device
        self.armed = False
        """The stream has stepped once: its slots are allocated (set by the `GpuStep`)."""
        self._limit: int | None = None
        """Bytes allocated when this backward began (None: keep nothing in it)."""
        self._held: set[int] = set()
        """id() of the groups of the units this backward kept."""
        self.kept = 0
        """Units kept so far, every backward counted (tests and benchmarks read it)."""
        for u in self._eligible.values():
            u.keeps_after_backward = self.keeps

    def begin_backward(self, *, sync: bool, early: bool) -> None:
        """A backward begins; `sync`: it closes the window; `early`: updates may start during it."""
        self._held.clear()
        if not (self._eligible and sync and not early and self.armed):
            self._limit = None
        elif self._cuda:
            self._limit = torch.cuda.memory_allocated(self.device)
        else:
            self._limit = CPU_BUDGET

    def keeps(self, unit: Unit) -> bool:
        """Backward is done with `unit`: True when it stays gathered (the caller releases it otherwise)."""
        size = self._bytes.get(id(unit))
        if self._limit is None or size is None or not unit.sharded:
            return False
        if all(id(g) in self._held for g in unit.trainable):  # kept already (asked again at backward's end)
            return True
        if self._cuda:
            fits = torch.cuda.memory_allocated(self.device) + size + self._margin <= self._limit
        else:
            fits = size <= self._limit
            self._limit -= size if fits else 0
        if fits:
            self._held.update(id(g) for g in unit.trainable)
            self.kept += 1
        return fits

    def holds(self, g: FlatGroup) -> bool:
        """`g`'s unit was kept by the last backward and is still gathered: the update reads and writes its
        parameters there."""
        return id(g) in self._held and g.gathered
