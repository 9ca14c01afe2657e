"""`NarrowHostState`: optimizer state stored in fewer bits for groups the CPU optimizer steps (host-stepped).

[Note: narrow state on the host]
With `precision.optimizer_state` bf16 or 8bit (see [Note: narrow optimizer state] in
zerofit.engine.state_codec) a host-stepped group keeps its state as GPU-stepped runs do: per run of pieces
(see [Note: runs] in zerofit.engine.offload.gpu_runs) and per-element key K, one home of codes (and, 8-bit,
of block scales) in host memory - or in the group's NVMe slot, where the swapper binds it - that each
piece's `K` and `K + ".absmax"` entries view (`offload/stored_homes.py`). Around the group's CPU step, on
the host stepper's thread, one group at a time:
  widen    every home decoded into an fp32 scratch buffer per key (one per key, as long as the largest
           group's shard, reused by every group), and each piece's `K` entry pointed at its part of it;
  step     the script's optimizer class steps the group as with fp32 state (it sees fp32 tensors);
  narrow   state the step created (a piece's first step) copied into the scratch, the padding between
           pieces zeroed (it must not raise a block's absmax), the scratch encoded into the homes and
           the entries pointed at them again.
Blocks are counted from each run's start, a multiple of 16 of the shard, as in the GPU's stream, and the
fp32 update is the same kernel on the same values: the stored state is the same bit for bit as when the
group is kept on the device or GPU-stepped. The scratch costs 4 bytes per element of the largest group
per key, once; with fp32 state none of this runs (the stepper steps the state in place, as always).
"""

from __future__ import annotations

import torch

from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.offload.gpu_runs import Run, is_streamed, plan_runs
from zerofit.engine.offload.stored_homes import (
    bind_stored,
    gap_index,
    is_scale_key,
    rehome_stored,
    stored_home_of,
    stored_keys,
)
from zerofit.engine.state_codec import Codec, Stored


class NarrowHostState:
    """Widens host-stepped groups' stored state into fp32 scratch for their step and narrows it back (see the
    note). Used by the host stepper's thread only."""

    def __init__(self, codec: Codec, optimizer: torch.optim.Optimizer, groups: list[FlatGroup]):
        assert codec.narrow, "fp32 state is stepped in place"
        self.codec = codec
        self.optimizer = optimizer
        # one run per param group's stretch of pieces: chunks are not streamed here, so one "chunk" per run
        self._runs = {id(g): plan_runs(g, optimizer, max(16, g.layout.shard_numel)) for g in groups}
        self._length = max((g.layout.shard_numel for g in groups), default=0)
        self._scratch: dict[str, torch.Tensor] = {}
        """Per state key: fp32 elements of the largest group's shard, the widened state of the group stepping."""
        self._gaps: dict[int, torch.Tensor | None] = {}
        self._open: dict[tuple[int, str], Stored] = {}
        """(id(run), key) -> the home widened for the step under way (`narrow` stores into it again)."""

    def widen(self, g: FlatGroup) -> None:
        """Before `g`'s step: every piece's stored state as fp32 views of the scratch."""
        state = self.optimizer.state
        for run in self._runs[id(g)]:
            for k in stored_keys(run, state):
                home = self._open[id(run), k] = self._home(run, k)
                wide = self._wide(k, run)
                self.codec.decode(home, wide, k)
                for p in run.pieces:
                    entry = state.get(p.master, {})
                    if k in entry:
                        entry[k] = wide[p.offset - run.start:p.offset - run.start + p.length]

    def narrow(self, g: FlatGroup) -> None:
        """After `g`'s step: the fp32 state stored into the homes (new ones for state the step created) and every
        piece's entries pointed at them."""
        state = self.optimizer.state
        for run in self._runs[id(g)]:
            for k in self._wide_keys(run):
                wide = self._wide(k, run)
                have = [p for p in run.pieces if k in state.get(p.master, {})]
                for p in have:  # state the optimizer made itself (a first step) joins the scratch
                    part = wide[p.offset - run.start:p.offset - run.start + p.length]
                    value = state[p.master][k]
                    if value.data_ptr() != part.data_ptr():
                        part.copy_(value)
                gaps = self._gap(run)
                if gaps is not None:
                    wide.index_fill_(0, gaps, 0.0)
                home = self._open.pop((id(run), k), None)
                if home is None:  # state the optimizer created in this step under a key not stored before
                    home = self.codec.empty(run.end - run.start, "cpu")
                self.codec.encode(wide, home, k)
                bind_stored(run, state, k, home, have)
        self._open.clear()

    def _home(self, run: Run, key: str) -> Stored:
        """The one home of `run`'s stored `key` (moved into one first if the pieces' entries do not lie so: a
        checkpoint load's, or state handed over in another form)."""
        state = self.optimizer.state
        home = stored_home_of(run, state, key, self.codec, pinned=_any)
        if home is None:
            home = self.codec.empty(run.end - run.start, "cpu")
            rehome_stored(run, state, key, home, self.codec)
        return home

    def _wide_keys(self, run: Run) -> list[str]:
        keys: list[str] = []
        for p in run.pieces:
            for k, v in self.optimizer.state.get(p.master, {}).items():
                if not is_scale_key(k) and is_streamed(v, p.length) and v.dtype == torch.float32 and k not in keys:
                    keys.append(k)
        return keys

    def _wide(self, key: str, run: Run) -> torch.Tensor:
        if key not in self._scratch:
            self._scratch[key] = torch.empty(self._length, dtype=torch.float32)
        return self._scratch[key][run.start:run.end]

    def _gap(self, run: Run) -> torch.Tensor | None:
        if id(run) not in self._gaps:
            self._gaps[id(run)] = gap_index(run, run.start, run.end - run.start, torch.device("cpu"))
        return self._gaps[id(run)]


def _any(_: torch.Tensor) -> bool:
    """Host state needs no page-locking for the CPU optimizer."""
    return True
