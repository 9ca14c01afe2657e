"""Stage 3: units that forwards without autograd leave gathered, under a budget.

[Note: kept units]
`model.generate()` runs one forward per new token; releasing every unit after each of them would
gather the whole model once per token. A forward that records no autograd (`torch.no_grad()`,
`torch.inference_mode()`: generation, evaluation, a reward or log-prob pass) has no backward that
could need a unit again, and nothing changes a shard until the next step, so the units it gathers
stay gathered ("kept") as long as they fit the budget: a generate call of T tokens gathers each kept
unit once, and later no-grad forwards before the next step gather nothing.

The invariant: a kept unit's full parameters always equal its shards. So every point that writes a
shard, or may write the full parameters, releases the kept units first:
- `ZeroEngine.step()`, `discard_window()`, `refresh_params()` (a checkpoint or `load_state_dict`
  wrote the masters): the step publishes new shards (an overlapped host step even after `step()`
  returns; a released unit waits for it in `Unit.gather`, a kept one would not); `zero_grad()` writes
  no shard and releases nothing;
- `Accelerator.gathered_parameters()` (`FullStateDict.held`), whose block may rewrite the full
  parameters (PEFT's merge) that are then dropped, and any `state_dict()` read, which gathers the units
  it copies one at a time anyway.
The other release points are about memory, not values: a forward that records autograd (the root's
pre-hook: training needs the room for activations) and the start of a backward. `model.train()` is
no release point (torch gives no hook for it without patching `nn.Module`); the next training forward
is. A unit used outside a no-grad forward (a training forward, a backward) is released as stage 3
always does; kept units are never in use there.

A model without an optimizer (DPO's or GRPO's reference model, a reward model) has none of these
release points: it only ever runs no-grad forwards, so whatever it kept would stay gathered for the
whole run, beside the trained model's activations. Its engine keeps nothing unless told to
(`keep_gathered_budget`).

Budget, in bytes of gathered parameters (a unit counts its full compute-dtype flat buffers): the
config's `zero.max_live_parameters` (DeepSpeed's `stage3_max_live_parameters`, in elements) when
written, else none of its own; 0 turns keeping off (TRL's `ds3_gather_for_generation=False`). On CUDA
the ranks also agree, when a no-grad forward opens a keeping session, on the smallest free device
memory of any rank minus a margin (KEEP_MARGIN_SHARE of the device, at least KEEP_MARGIN_MIN bytes:
generation's KV cache and activations grow per token), so every rank keeps the same units and the
gathers stay in one order on every rank ([Note: one gather order]). Units are admitted in the order
they finish their forward, the root first; one that does not fit is released as always, and gathered
again, with the next unit prefetched, at every later forward: streaming, as training forwards do.
"""

from __future__ import annotations

import torch

from zerofit.engine.comm import Collectives
from zerofit.engine.unit import ParamState, Unit
from zerofit.errors import EngineError

KEEP_MARGIN_SHARE = 0.10
"""Share of the device's memory a keeping session leaves free (CUDA), for activations and the KV cache."""
KEEP_MARGIN_MIN = 1 << 30
"""At least this many bytes are left free (CUDA)."""


def gathered_bytes(unit: Unit) -> int:
    """Bytes the unit's sharded groups hold while gathered (0: nothing to gather)."""
    return sum(g.layout.padded_numel * g.param_flat.element_size() for g in unit.groups if g.placement.shard_params)


def configured_budget(*, has_optimizer: bool, max_live_parameters, compute_dtype: torch.dtype) -> int | None:
    """Bytes no-grad forwards may keep gathered: `zero.max_live_parameters` elements in the compute dtype,
    None when it is not written; 0 for a model without an optimizer (nothing would ever release them)."""
    if not has_optimizer:
        return 0
    if max_live_parameters is None:
        return None
    return int(max_live_parameters) * torch.empty((), dtype=compute_dtype).element_size()


class KeptUnits:
    """The units no-grad forwards keep gathered until the next release point (see [Note: kept units])."""

    def __init__(self, comm: Collectives, budget: int | None = None):
        self.comm = comm
        self.budget = budget
        """Bytes of gathered parameters that may be kept: None: no cap of its own (on CUDA the free memory
        still bounds it), 0: keep nothing."""
        self._units: dict[int, Unit] = {}
        self._bytes = 0
        self._limit: int | None = None
        """The bytes this session may keep (None: no session open)."""

    def set_budget(self, budget: int | None) -> None:
        """A new budget (bytes, 0 or None: see `budget`); what was kept is released first."""
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise EngineError(f"keep_gathered_budget must be a number of bytes >= 0 or None (got {budget!r}): "
                              "0 streams every unit in generation, None keeps what fits the device")
        self.release()
        self.budget = budget

    @property
    def open(self) -> bool:
        """A keeping session is open: no-grad forwards since the last release point may keep units."""
        return self._limit is not None

    @property
    def units(self) -> list[Unit]:
        return list(self._units.values())

    @property
    def nbytes(self) -> int:
        """Bytes of gathered parameters kept now."""
        return self._bytes

    def begin(self) -> None:
        """A no-grad forward of the root begins: open a session unless one is open (every rank at once)."""
        if self._limit is not None or self.budget == 0:
            return
        limit = self.budget
        if self.comm.device.type == "cuda":
            free = _usable_bytes(self.comm.device)
            limit = free if limit is None else min(limit, free)
        if self.comm.world > 1 and self.comm.device.type == "cuda":
            # Every rank must keep the same units, or their gathers would pair with different units.
            agreed = torch.tensor([-limit], dtype=torch.float64, device=self.comm.device)
            limit = int(-self.comm.max_now(agreed, "keep_budget").item())
        self._limit = -1 if limit is None else max(limit, 0)  # -1: no limit

    def holds(self, unit: Unit) -> bool:
        return id(unit) in self._units

    def admit(self, unit: Unit) -> bool:
        """Keep `unit` gathered if the session's budget has room; True when it is kept."""
        if id(unit) in self._units:
            return True
        if self._limit is None or unit.state is ParamState.RELEASED:
            return False
        size = gathered_bytes(unit)
        if self._limit >= 0 and self._bytes + size > self._limit:
            return False
        self._units[id(unit)] = unit
        self._bytes += size
        return True

    def release(self) -> None:
        """A release point: every kept unit released, the session closed."""
        for unit in self._units.values():
            unit.release()
        self._units.clear()
        self._bytes = 0
        self._limit = None


def _usable_bytes(device: torch.device) -> int:
    """Device memory a session may fill: free memory (the allocator's cached blocks included) less the margin."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(free + cached - max(int(KEEP_MARGIN_SHARE * total), KEEP_MARGIN_MIN), 0)
