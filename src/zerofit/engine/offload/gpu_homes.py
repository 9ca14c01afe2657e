"""`RunHomes`: where each run of a GPU-stepped part keeps its per-element optimizer state, and what a step of the
run reads off its pieces' state entries (see [Note: runs] in zerofit.engine.offload.gpu_runs).

[Note: verified homes]
Before a run is stepped, every piece's per-element state must view the run's one home: `home_of` and
`stored_home_of` check the storage, offset, dtype and page-locking of every view, and state that does not
lie so (a checkpoint load's) is moved there. That walk over every piece's state costs the issuing thread
more than the run's copies when the run is small, and its answer rarely changes, so once it has passed and
every piece has state, what it found is kept: the homes, each piece's state entry (the dict object) with
its size, and the per-element tensors in it. A later step only confirms that every piece still has that
entry, of as many keys, holding the same tensor objects, and then takes the kept answer. Whatever changes
where a run's state lives replaces one of these: a checkpoint load gives every piece a new entry
(`optimizer.state[t] = {}`), torch's `load_state_dict` new tensors, an optimizer that creates state under
a new key adds a key. The NVMe swapper is the one exception - it rebinds the same tensor objects to another
slot (`set_`) every step - so runs with a swapper are walked in full at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.gpu_runs import Run, home_of, is_streamed, probe_state_keys, rehome, state_keys
from zerofit.engine.offload.stored_homes import is_scale_key, rehome_stored, stored_home_of, stored_keys
from zerofit.engine.pinned import pinned_empty
from zerofit.engine.state_codec import Codec, Stored


@dataclass(frozen=True)
class PieceState:
    """What one step reads off a piece's state entry."""

    entry: dict | None
    """The piece's `optimizer.state` entry; None: the piece has no state yet (its first step creates it)."""
    held: tuple[str, ...] = ()
    """The run's home keys the piece holds (per-element state: stepped from the slot's buffers)."""
    skip: frozenset[str] = frozenset()
    """Keys of the entry that are not scalar state (per-element state and its block scales)."""


@dataclass(frozen=True)
class RunState:
    """A run's homes (per-element state key -> its one home) and, per piece of the run in order, its state."""

    homes: dict[str, torch.Tensor | Stored]
    pieces: tuple[PieceState, ...]
    _chunks: dict[int, dict[str, torch.Tensor | Stored]] = field(default_factory=dict)

    def chunk(self, lo: int, n: int) -> dict[str, torch.Tensor | Stored]:
        """Per key, elements [lo, lo + n) of the run in its home (a new dict, of views made once while kept)."""
        views = self._chunks.get(lo)
        if views is None or len(views) != len(self.homes):
            views = self._chunks[lo] = {k: h.slice(lo, n) if isinstance(h, Stored) else h[lo:lo + n]
                                        for k, h in self.homes.items()}
        return dict(views)


@dataclass(frozen=True)
class _Verified:
    state: RunState
    checks: tuple[tuple[dict, int, tuple[tuple[str, torch.Tensor], ...]], ...]
    """Per piece: its entry, the entry's size, and (key, tensor) of the per-element state in it."""


class RunHomes:
    """The state homes of every run of a GPU-stepped part (see the module note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, codec: Codec, device: torch.device, *,
                 resident: set[int], swapped: bool):
        """`resident`: ids of the groups kept on the device (homes in device memory); `swapped`: the state lives
        in NVMe files, bound to the swapper's slots (never kept: see the note)."""
        self.optimizer = optimizer
        self.codec = codec
        self.device = device
        self._cuda = device.type == "cuda"
        self._resident = resident
        self._swapped = swapped
        self.homes: dict[int, dict[str, torch.Tensor | Stored]] = {}
        """id(run) -> per state key, the home its pieces' state views (allocated at prepare, or at a first step)."""
        self._verified: dict[int, _Verified] = {}
        self._pinned: set[int] = set()
        """data_ptr of host storages known to be page-locked."""

    def allocate(self, g: FlatGroup, runs: list[Run]) -> None:
        """[Note: homes at prepare]
        Every run's state homes are allocated when the mode is built (at `prepare()`), for the per-element state
        the script's optimizer class creates (found by stepping one on a 16-element tensor): page-locking tens
        of GiB of host memory takes seconds, and inside the first steps it stalled step 2 of a 9 B run for ~20 s.
        A key the probe did not see gets its home at its first step, as before."""
        keys: dict[int, dict[str, torch.dtype]] = {}
        for run in runs:
            if run.group not in keys:
                keys[run.group] = probe_state_keys(self.optimizer, run.group)
            self.homes[id(run)] = {k: self.new_home(g, run, k, dtype) for k, dtype in keys[run.group].items()}

    def of(self, g: FlatGroup, run: Run) -> RunState:
        """`run`'s homes and its pieces' state, now: the kept answer while it holds, else worked out afresh (see
        the note); state that does not view the run's home is moved there."""
        kept = self._verified.get(id(run))
        if kept is not None and self._holds(run, kept):
            return kept.state
        self._verified.pop(id(run), None)
        return RunState(self._verify(g, run), self._pieces(run))

    def stepped(self, run: Run, state: RunState, changed: bool) -> None:
        """After `run`'s step was issued with `state`: keep what holds for the next step, unless the state may
        have moved since (`changed`: a piece got state under a new key)."""
        if self._swapped or (not changed and id(run) in self._verified):
            return
        pieces = self._pieces(run)
        if any(p.entry is None for p in pieces):  # a piece still without state: its first step comes later
            self._verified.pop(id(run), None)
            return
        checks = tuple((p.entry, len(p.entry), tuple((k, v) for k, v in p.entry.items() if k in p.skip))
                       for p in pieces)
        self._verified[id(run)] = _Verified(RunState(state.homes, pieces), checks)

    def add(self, g: FlatGroup, run: Run, key: str, dtype: torch.dtype) -> torch.Tensor | Stored:
        """A home for state a piece created under a key the run had none for."""
        home = self.homes[id(run)][key] = self.new_home(g, run, key, dtype)
        return home

    def new_home(self, g: FlatGroup, run: Run, key: str, dtype: torch.dtype) -> torch.Tensor | Stored:
        """A home for `run`'s `key` state: stored as the codec says (fp32 state), on the device for a group
        kept there, else in page-locked host memory."""
        n = run.end - run.start
        if id(g) in self._resident:
            make = partial(_device_empty, device=self.device)
        else:
            make = self._host_tensor
        if self.codec.narrow and dtype == torch.float32:
            return self.codec.empty(n, None, make=make)
        return make(n, dtype)

    # --- the full walk ----------------------------------------------------------------------------
    def _holds(self, run: Run, kept: _Verified) -> bool:
        state = self.optimizer.state
        for p, (entry, size, tensors) in zip(run.pieces, kept.checks):
            if state.get(p.master) is not entry or len(entry) != size:
                return False
            for k, v in tensors:
                if entry.get(k) is not v:
                    return False
        return True

    def _verify(self, g: FlatGroup, run: Run) -> dict[str, torch.Tensor | Stored]:
        """Per per-element state key of `run`: the one home every piece's state views (see [Note: runs]);
        state that does not lie so (a checkpoint load's, pageable) is moved into the run's home now. Keys no
        piece holds yet come with the home allocated for them (a piece's first step fills it)."""
        state = self.optimizer.state
        mine = self.homes.setdefault(id(run), {})
        homes: dict[str, torch.Tensor | Stored] = {}
        if self.codec.narrow:
            for k in stored_keys(run, state):
                home = stored_home_of(run, state, k, self.codec, pinned=self._is_pinned)
                if home is None:
                    home = mine.get(k) or self.new_home(g, run, k, torch.float32)
                    rehome_stored(run, state, k, home, self.codec)
                homes[k] = mine[k] = home
        else:
            for k, dtype in state_keys(run, state).items():
                home = home_of(run, state, k, pinned=self._is_pinned)
                if home is None:
                    home = mine.get(k)
                    if home is None or home.dtype != dtype:
                        home = self.new_home(g, run, k, dtype)
                    rehome(run, state, k, home)
                homes[k] = mine[k] = home
        for k, home in mine.items():
            homes.setdefault(k, home)
        return homes

    def _pieces(self, run: Run) -> tuple[PieceState, ...]:
        state = self.optimizer.state
        homes = self.homes.get(id(run), {})
        out = []
        for p in run.pieces:
            entry = state.get(p.master)
            if not entry:
                out.append(PieceState(None))
                continue
            held = tuple(k for k in homes if k in entry)
            skip = frozenset(k for k, v in entry.items() if is_streamed(v, p.length) or is_scale_key(k))
            out.append(PieceState(entry, held, skip))
        return tuple(out)

    # --- host memory ------------------------------------------------------------------------------
    def _is_pinned(self, t: torch.Tensor) -> bool:
        if not self._cuda or self._swapped or t.device.type != "cpu":  # NVMe: the swapper's slots are what the
            # copies read; a home on the device needs no locking
            return True
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._pinned and t.is_pinned():
            self._pinned.add(ptr)
        return ptr in self._pinned

    def _host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = pinned_empty(numel, dtype) if self._cuda else torch.empty(numel, dtype=dtype)
        self._pinned.add(t.data_ptr())
        return t


def _device_empty(numel: int, dtype: torch.dtype, *, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)
