"""Where each rank is: a rank left alone at a collective call fails in seconds instead of hanging.

[Note: checked places]
The commonest way to hang a ZeRO run at its end is `if accelerator.is_main_process:
model.save_pretrained(...)`: under stage 3 the main process's `state_dict()` gathers the parameters
from every rank, and the others never join - they wait in `wait_for_everyone()` or `end_training()`,
have exited, or are in the next step's forward. Every rank then waits until the process-group timeout
(30 minutes by default) for an error that names a collective, not the cause. A plain timeout cannot
tell that apart from a rank that is only late, so ranks say where they are instead.

At a few *checked places* - the gather walks of a full state dict (`model.state_dict()` at stage 3,
`get_state_dict`, `save_model`), the sharded checkpoint (`save_state`, `load_state`, and what calls
them: the Trainer's checkpoints, `model.save_checkpoint`), the Accelerator's barrier
(`wait_for_everyone`, `end_training`) and
the process's exit - a rank first writes where it is to the run's key-value store, then waits until
every rank has written the same kind of place, and only then enters the collective (so no rank ever
enters an NCCL collective alone). Each rank numbers the places it reaches 1, 2, 3, ...; in a correct
script every rank reaches the same places in the same order, so the n-th place is the same everywhere.
When another rank's n-th place is a different one (or its exit), both ranks raise `RanksApartError` at
once, naming what each is doing, the usual cause and the fix. A rank that has not reached its n-th
place yet may only be late (still computing): it is waited for, with a notice after SILENT_AFTER_S
and an error at the process-group timeout. The training loop's own collectives are not checked
places: they are many, and the store costs a round trip.

Keys, under this attempt's prefix and a number per process group (`.../arrival/<g>/`): `<n>/is/<kind>`
counts the ranks whose n-th place is of that kind, `<n>/all` every rank that reached its n-th place.
A rank adds the first before the second, so one read that finds `all` above `is/<its kind>` proves
another kind. `rank/<r>` is rank r's latest place, for messages. A place costs a rank three round
trips and its polls (the last rank to arrive polls not at all); rank 0 drops place n-1's counters once
place n passed, when every rank is done with them.

[Note: a rank that went on training]
A rank that skipped the place and went on to the next training step writes nothing: it is blocked in
that step's first collective, which the waiting rank never joins. So every collective zerofit names
(`zerofit.distributed.failures.named`: the engine's, the front end's, the checkpoint's) counts itself here,
and a watcher thread looks at the store when that count has not moved for STALL_S. If another rank
waits at this rank's next place having entered fewer collectives than this rank has, this rank is in
a collective that rank cannot reach before the place: the watcher records "went on" at that place
(the waiting rank raises) and prints the mirrored message, which this rank's collective error repeats
once the other rank exits (`zerofit.distributed.failures.describe`). While collectives keep completing the
watcher never touches the store.

The check needs a store every rank reaches: the one `zerofit.distributed.process_group.join` formed the
group through, else a client of the store at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or
rank 0's when the script called `init_process_group()` itself). The ranks agree in `open_board` whether
every one has it; if not (a `file://` rendezvous, no MASTER_ADDR) the check is off, and a gather
only says, after SILENT_AFTER_S, why it may be waiting forever (`notice_if_alone`). With one process
nothing is checked and the store is never used.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from zerofit.distributed import process_group
from zerofit.errors import CollectiveError, RanksApartError

SILENT_AFTER_S = 60.0
"""Seconds a rank waits for the others at a checked place (with the check off: in one unit's gather)
before it prints why it may be waiting forever."""

STALL_S = 2.0
"""Seconds without a new collective after which the watcher looks whether a rank waits for this one."""

_WATCH_EVERY_S = 0.5
_FIRST_POLL_S, _LAST_POLL_S = 0.002, 0.25
"""A waiting rank reads the store after 2 ms, then twice as long each time, up to a quarter second."""
_CONNECT_TIMEOUT = timedelta(seconds=10)
"""How long `open_board` tries to reach the store at MASTER_ADDR:MASTER_PORT (and each later request may take)."""
_TIMEOUT_KEY = "launch.process_group_timeout"

notices: list[str] = []
"""The notices printed in this process (for tests)."""


@dataclass(frozen=True)
class Place:
    """A checked place: `kind` must be the same on every rank; `doing` says it, after "rank N"."""

    kind: str
    doing: str
    gathers: bool = False
    """It gathers sharded parameters: standing alone there is usually a save under is_main_process."""


def state_dict_place(module: str) -> Place:
    return Place("state_dict", f"is in {module}.state_dict() (which save_pretrained calls)", gathers=True)


GET_STATE_DICT = Place("get_state_dict", "is in accelerator.get_state_dict(model)", gathers=True)
SAVE_MODEL = Place("save_model", "is in accelerator.save_model(model, ...)", gathers=True)
GATHERED_PARAMETERS = Place("gathered_parameters", "is in accelerator.gathered_parameters(model)", gathers=True)
SAVE_STATE = Place("save_state", "is in accelerator.save_state(...) (every rank writes its own shard of the "
                                 "checkpoint, so every rank must call it)")
LOAD_STATE = Place("load_state", "is in accelerator.load_state(...) (every rank reads its own shard of the "
                                 "checkpoint, so every rank must call it)")
WAIT_FOR_EVERYONE = Place("barrier", "is in accelerator.wait_for_everyone()")
END_TRAINING = Place("barrier", "is in accelerator.end_training() (which waits for every rank)")
EXITED = Place("exit", "has left the script (its process is exiting)")
WENT_ON = Place("went_on", "went on to a later collective of the script (e.g. the next training step's "
                           "forward or backward) without calling it")


def apart_message(rank: int, doing: str, others: list[tuple[int, str]], gathers: bool) -> str:
    """What a rank that stands apart says: what it and (up to three of) the others are doing, the cause, the fix."""
    shown = [f"rank {r} {what}" for r, what in others[:3]]
    more = f" (and {len(others) - 3} more ranks elsewhere)" if len(others) > 3 else ""
    head = (f"rank {rank} {doing}, while {', '.join(shown) or 'another rank is at a different call'}{more}: "
            "each waits for the other, so the run would hang until the process-group timeout; zerofit stops here. ")
    return head + _cause_and_fix(gathers)


def _cause_and_fix(gathers: bool) -> str:
    if gathers:
        return ("Under ZeRO, save_pretrained and state_dict() (at stage 3), accelerator.get_state_dict and "
                "accelerator.save_model gather the parameters from every rank, so every rank must call them; the "
                "usual cause is calling one under `if accelerator.is_main_process:`. Fix: call it on every rank and "
                "let the main process write: accelerator.unwrap_model(model).save_pretrained(directory, "
                "is_main_process=accelerator.is_main_process, save_function=accelerator.save), or "
                "accelerator.save_model(model, directory).")
    return ("Every rank must make the same collective calls in the same order; the usual cause is one under "
            "`if accelerator.is_main_process:`, or a loop that runs a different number of times on each rank "
            "(a DataLoader not passed to prepare()).")


@dataclass(frozen=True)
class _Record:
    """A rank's latest place, as `rank/<r>` holds it."""

    seq: int
    kind: str
    doing: str
    gathers: bool
    collectives: int
    """Collectives this rank had entered when it got there (see [Note: a rank that went on training])."""

    def encode(self) -> str:
        return json.dumps([self.seq, self.kind, self.doing, self.gathers, self.collectives])

    @classmethod
    def decode(cls, raw: bytes) -> _Record:
        return cls(*json.loads(raw))


_collectives = 0
"""Collectives this process entered (counted by `zerofit.distributed.failures.named`, on every rank alike)."""
_collectives_lock = threading.Lock()
"""A lost count would make the ranks' counts differ: worker threads may enter collectives too."""
_generation = 0
"""Process groups this process opened a board for: the same count on every rank, so the same keys."""
_board: Board | None = None
_apart: str | None = None
"""The message this rank raised or printed when it found itself apart from the others."""


def note_collective() -> None:
    """Count one collective entered (cheap: `failures.named` calls it on the hot path)."""
    global _collectives
    with _collectives_lock:
        _collectives += 1


def known_apart() -> str | None:
    """Why this rank stands apart from the others, when it found out (for collective errors that follow)."""
    return _apart


def current() -> Board | None:
    """The board of the current process group (None: the check is off)."""
    return _board


class Board:
    """This rank's records in the run's store, for one process group (see [Note: checked places])."""

    def __init__(self, store: dist.Store, rank: int, world: int, group: object):
        self.store, self.rank, self.world, self.group = store, rank, world, group
        self.seq = 0
        """Checked places this rank has reached."""
        self.store_calls = 0
        """Round trips the checked places cost this rank (the watcher's are not counted)."""
        self.waiting = False
        """The main thread is at a checked place (the watcher then leaves the store alone)."""
        self._kinds: dict[int, str] = {}
        self._base = _collectives
        self.pid = os.getpid()
        """The process the board speaks for: a child forked from it (that runs atexit) must not say it exited."""
        self._watch = _Watch(self)

    def collectives(self) -> int:
        return _collectives - self._base

    def start(self) -> None:
        self._watch.start()

    def close(self) -> None:
        self._watch.stop.set()

    # --- a checked place ---------------------------------------------------------------------------
    def check_in(self, place: Place) -> None:
        self.waiting = True
        try:
            self.seq += 1
            if self._post(place, self.seq) < self.world:
                self._wait(place, self.seq)
        finally:
            self.waiting = False
        self._kinds[self.seq] = place.kind
        if self.rank == 0 and self.seq - 1 in self._kinds:  # every rank reached this place: all are past the last
            kind = self._kinds.pop(self.seq - 1)
            self._call(place, self.store.delete_key, f"{self.seq - 1}/all")
            self._call(place, self.store.delete_key, f"{self.seq - 1}/is/{kind}")

    def _post(self, place: Place, seq: int) -> int:
        """Record `place` as this rank's `seq`-th; returns how many ranks' `seq`-th place is of its kind."""
        record = _Record(seq, place.kind, place.doing, place.gathers, self.collectives())
        self._call(place, self.store.set, f"rank/{self.rank}", record.encode())
        same = self._call(place, self.store.add, f"{seq}/is/{place.kind}", 1)
        self._call(place, self.store.add, f"{seq}/all", 1)
        return same

    def _wait(self, place: Place, seq: int) -> None:
        limit = process_group.current_timeout_s() or dist.default_pg_timeout.total_seconds()
        started, delay, noticed = time.monotonic(), _FIRST_POLL_S, False
        while True:
            total, same = (int(v) for v in self._call(place, self.store.multi_get,
                                                       [f"{seq}/all", f"{seq}/is/{place.kind}"]))
            if total > same:
                raise self._apart_error(place, seq)
            if same >= self.world:
                return
            waited = time.monotonic() - started
            if waited >= SILENT_AFTER_S and not noticed:
                noticed = True
                self._notice_silent(place, seq, waited, limit)
            if waited >= limit:
                late = self._late(place, seq)
                raise CollectiveError(
                    f"rank {self.rank} {place.doing} and waited {limit:g} s ({_TIMEOUT_KEY}) for rank(s) {late}, which "
                    f"never reached it: they are hung, or took another path through the script. "
                    f"{_cause_and_fix(place.gathers)} If they are only slow, raise {_TIMEOUT_KEY}.",
                    label=place.kind, rank=self.rank)
            time.sleep(delay)
            delay = min(2 * delay, _LAST_POLL_S)

    def _apart_error(self, place: Place, seq: int) -> RanksApartError:
        global _apart
        records = self._records(place)
        others = [(r, rec.doing) for r, rec in records.items()
                  if r != self.rank and rec.seq >= seq and (rec.seq, rec.kind) != (seq, place.kind)]
        gathers = place.gathers or any(rec.gathers for rec in records.values() if rec.seq == seq)
        _apart = apart_message(self.rank, place.doing, others, gathers)
        return RanksApartError(_apart, label=place.kind, rank=self.rank)

    def _late(self, place: Place, seq: int) -> str:
        return ", ".join(str(r) for r, rec in self._records(place).items() if rec.seq < seq) or "?"

    def _notice_silent(self, place: Place, seq: int, waited: float, limit: float) -> None:
        text = (f"zerofit: rank {self.rank} {place.doing} and has waited {waited:.0f} s for rank(s) "
                f"{self._late(place, seq)}, which have not reached it yet. If they are still busy (evaluating, "
                f"writing files) this is fine; if they never call it, the run waits here until the process-group "
                f"timeout ({limit:g} s). {_cause_and_fix(place.gathers)}")
        notices.append(text)
        print(text, file=sys.stderr, flush=True)

    def _records(self, place: Place | None = None) -> dict[int, _Record]:
        keys = [f"rank/{r}" for r in range(self.world)]
        raw = self.store.multi_get(keys) if place is None else self._call(place, self.store.multi_get, keys)
        return {r: _Record.decode(v) for r, v in enumerate(raw)}

    def _call(self, place: Place, request, *args):
        """One round trip; a store that does not answer becomes an error that says what was being checked."""
        self.store_calls += 1
        try:
            return request(*args)
        except RuntimeError as e:  # torch's DistStoreError and a lost connection are both RuntimeErrors
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise CollectiveError(
                f"rank {self.rank} {place.doing}, and the run's key-value store did not answer while this rank "
                f"checked that every rank got there ({first}): the process that hosts it (torchrun's agent, or "
                "rank 0 when the script created the process group) has probably exited; check the other ranks' "
                "logs.", label=place.kind, rank=self.rank) from e

    # --- the watcher and the exit ------------------------------------------------------------------
    def look_ahead(self, entered: int) -> None:
        """[Note: a rank that went on training] Record "went on" where another rank waits at this rank's
        next place having entered fewer collectives than this rank (`entered`)."""
        global _apart
        seq = self.seq + 1
        if not self.store.check([f"{seq}/all"]):
            return
        waiting = [(r, rec) for r, rec in self._records().items()
                   if r != self.rank and rec.seq == seq and rec.collectives < entered]
        if not waiting or self.waiting or self.seq + 1 != seq:
            return
        _apart = apart_message(self.rank, WENT_ON.doing, [(r, rec.doing) for r, rec in waiting],
                               any(rec.gathers for _, rec in waiting))
        self.store.set(f"rank/{self.rank}", _Record(seq, WENT_ON.kind, WENT_ON.doing, False, entered).encode())
        self.store.add(f"{seq}/is/{WENT_ON.kind}", 1)
        self.store.add(f"{seq}/all", 1)
        print(f"zerofit: {_apart}", file=sys.stderr, flush=True)

    def leave(self) -> None:
        """Record the exit as this rank's next place; say so where a rank already waits there for another call."""
        seq = self.seq + 1
        waiting = {}
        if self.store.check([f"{seq}/all"]):
            waiting = {r: rec for r, rec in self._records().items()
                       if r != self.rank and rec.seq == seq and rec.kind not in (EXITED.kind, WENT_ON.kind)}
        self.seq = seq
        self._post(EXITED, seq)
        if waiting:
            text = apart_message(self.rank, EXITED.doing, [(r, rec.doing) for r, rec in waiting.items()],
                                 any(rec.gathers for rec in waiting.values()))
            print(f"zerofit: {text}", file=sys.stderr, flush=True)


class _Watch(threading.Thread):
    """Wakes every half second; looks at the store only while this rank's collectives have stalled."""

    def __init__(self, board: Board):
        super().__init__(name="zerofit-arrival-watch", daemon=True)
        self.board = board
        self.stop = threading.Event()

    def run(self) -> None:
        seen, moved, looked = -1, time.monotonic(), 0.0
        while not self.stop.wait(_WATCH_EVERY_S):
            now, entered = time.monotonic(), self.board.collectives()
            if entered != seen:
                seen, moved = entered, now
                continue
            if now - moved < STALL_S or now - looked < STALL_S or self.board.waiting or _apart is not None:
                continue
            looked = now
            try:
                self.board.look_ahead(entered)
            except Exception:  # noqa: BLE001 - a watcher must never take the rank down; check_in reports store trouble
                pass


# --- entry points ----------------------------------------------------------------------------------
def open_board(*, created: bool) -> None:
    """Start checking places for the default process group; every rank calls it once the group exists
    (`ProcessState.create`), and a second call for the same group does nothing. `created`: zerofit's
    `process_group.join` formed the group (its store is then used directly)."""
    global _board, _generation
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = dist.group.WORLD
    if _board is not None and _board.group is group:
        return
    if _board is not None:
        _board.close()
    _board = None
    _generation += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    store = (process_group.joined_store() if created else None) or _connect()
    if store is not None:
        store = dist.PrefixStore(f"arrival/{_generation}", store)
        try:
            store.set(f"rank/{rank}", _Record(0, "start", "has reached no checked place yet", False, 0).encode())
        except RuntimeError:
            store = None
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, store is not None)  # on only if every rank has the store: none waits in vain
    if store is None or not all(everyone):
        return
    _board = Board(store, rank, world, group)
    _board.start()
    _register_exit()


def _connect() -> dist.Store | None:
    """A client of the store at MASTER_ADDR:MASTER_PORT in this attempt's key space, or None."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not (port or "").isdigit():
        return None
    try:
        return process_group.agent_store(_CONNECT_TIMEOUT)
    except (RuntimeError, ValueError):
        return None


def check_in(place: Place) -> None:
    """Before a collective at `place`: wait until every rank is there; raise RanksApartError at once if
    another rank is at a different place (see [Note: checked places]). Nothing when the check is off."""
    if _board is not None:
        _board.check_in(place)


def leave() -> None:
    """This process is exiting: record it, so a rank waiting for it raises now (atexit runs it; a harness
    whose ranks end without atexit, like `zerofit.testing.distributed`, calls it). Idempotent."""
    global _board
    board, _board = _board, None
    if board is None or board.pid != os.getpid():
        return
    board.close()
    if _apart is not None:  # its record stays the place where it stood apart: the others name that one
        return
    try:
        board.leave()
    except Exception:  # noqa: BLE001 - the store may be gone with the launcher: exiting must not fail on it
        pass


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(leave)
        _exit_registered = True


@contextlib.contextmanager
def notice_if_alone(module: str) -> Iterator[None]:
    """With the check off: around one unit's gather, print after SILENT_AFTER_S why it may wait forever
    (the unit's gather takes seconds at most when every rank takes part, whatever the model's size)."""
    if _board is not None:
        yield
        return

    def notice() -> None:
        text = (f"zerofit: {module}.state_dict() has waited {SILENT_AFTER_S:.0f} s for the other ranks: "
                f"{_cause_and_fix(True)} If only the main process calls it, the run waits here until the "
                "process-group timeout.")
        notices.append(text)
        print(text, file=sys.stderr, flush=True)

    timer = threading.Timer(SILENT_AFTER_S, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
