"""The order stage 3 gathers its units in: learned from the forwards, and the same on every rank.

[Note: one gather order]
NCCL pairs collectives by the order each rank issues them (see [Note: one collective order] in
zerofit.engine.engine, which settles the reductions). At stage 3 the gathers are issued by the model's
own hooks, so a block one rank skips (LayerDrop drawn per rank, an MoE expert no token of this rank
chose, a branch on this rank's data) or a head whose output this rank leaves out of its loss would move
or drop that rank's gathers, and the reductions issued between them. Every rank therefore walks one
schedule, the units in the order the forward runs them, and a unit it skips is stood in for:
- forward: entering a unit, the units the schedule has before it that this forward has not reached
  are stood in for first: gathered, their successor prefetched, released - the collectives a rank
  that runs them issues there; the units left at the end of the forward are stood in for when the
  root's forward ends. A unit met again (run twice) or not in the schedule is gathered on demand.
- backward runs the last forward's schedule backwards: when a unit's backward begins, the units
  the schedule has after it that backward has not reached are passed: one that had no backward of
  its own here is gathered and its predecessor prefetched (the stand-in), and its trainable
  parameters that have no gradient yet are taken to get none in this backward, so its reduction goes
  out now, in order, with zeros for them. The units left when backward ends are passed then.
Why the last point holds: autograd runs, among the nodes ready, the one created last (and gradient
accumulation before any), so when the backward of a unit's forward call begins, every node created
after that call has run, every later unit's gradients included. With several forwards before one
backward that no longer says a unit is done (its earlier call's backward is still to come), so there
only units that no forward since the last backward ran are passed; a unit some ranks run and others
leave out of the loss is then not covered. Passing a unit whose gradient arrives later is an error
(`ZeroEngine` raises it), never a silent loss. On one rank nothing pairs: nothing is stood in for or
passed, and the schedule only drives prefetching.
The schedule is learned from each training forward (the units in the order they ran, a stood-in unit
where it was stood in for), so it is the same on every rank as long as the ranks differ only in units
they skip; the first forward, having no record, follows the order the units were registered in. Only
forwards with gradients on stand in: evaluation and generation gather on demand, prefetching along
the last such forward's order, kept apart (generate() runs an encoder-decoder's decoder alone at
every token, and standing in for its encoder there would gather the whole encoder per token), so
there ranks must run the same units - as they do unless a model routes by data in evaluation (an
MoE). A unit no rank runs (an unused module) is stood in for by every rank in every training forward:
consistent, and one gather of it wasted per forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

from zerofit.engine.unit import Unit


def _first_seen(units: list[Unit]) -> list[Unit]:
    seen: set[int] = set()
    return [u for u in units if not (id(u) in seen or seen.add(id(u)))]


class _Schedule:
    """Units in the order a kind of forward (training, or evaluation) ran them last."""

    def __init__(self, units: list[Unit], seen: int = 0):
        self.units = units
        self.pos = {id(u): i for i, u in enumerate(units)}
        self.seen = seen
        """How many leading units a forward reached (the rest follow in registration order): only those are
        prefetched, so a forward never prefetches a unit the last one did not run."""

    @property
    def learned(self) -> bool:
        return self.seen > 0

    def after(self, i: int) -> Unit | None:
        """The unit to prefetch after the one at `i`."""
        return self.units[i + 1] if i + 1 < self.seen else None

    def learn(self, visits: list[tuple[Unit, bool]]) -> _Schedule:
        """The schedule those visits make: the units that ran in order, a stood-in unit where it was stood in for
        (unless it also ran), then the units the forward never reached, as they were."""
        ran = {id(u) for u, did in visits if did}
        order = _first_seen([u for u, did in visits if did or id(u) not in ran])
        placed = {id(u) for u in order}
        return _Schedule(order + [u for u in self.units if id(u) not in placed], seen=len(order))


class GatherOrder:
    """Walks the schedule in forward and backward; `pass_over(unit)` lets the engine reduce a passed unit."""

    def __init__(self, units: list[Unit], *, ordered: bool, pass_over: Callable[[Unit], None]):
        self.training = _Schedule(list(units))
        """The order every rank's training forwards follow (registration order before any forward)."""
        self.evaluation: _Schedule | None = None
        """The order of the last forward without gradients, for its prefetches only (None: none ran yet)."""
        self.ordered = ordered
        """Several ranks: stand in for skipped units and pass units in backward (see the Note)."""
        self._pass_over = pass_over
        self._now = self.training
        """The schedule of the forward under way."""
        self._at = 0
        self._visits: list[tuple[Unit, bool]] = []
        """This forward's units in order, each with whether it ran (False: stood in for)."""
        self._last_grad_visits: list[tuple[Unit, bool]] = []
        self._unlearned: tuple[bool, list[tuple[Unit, bool]]] | None = None
        """(with gradients, visits) of the last forward, until the next one begins and learns from it."""
        self._standing_in = False
        self._ran_since_backward: set[int] = set()
        self._forwards_since_backward = 0
        self._backward: list[Unit] = []
        self._back_pos: dict[int, int] = {}
        self._back_at = 0
        self._back_seen: set[int] = set()

    # --- forward ----------------------------------------------------------------------------------
    def begin_forward(self, *, with_grad: bool) -> None:
        """The root's forward begins; `with_grad`: a training forward (stand-ins happen in those only)."""
        if self._unlearned is not None:
            trained, visits = self._unlearned
            if trained:
                self.training = self.training.learn(visits)
            else:
                self.evaluation = (self.evaluation or self.training).learn(visits)
            self._unlearned = None
        self._now = self.training if with_grad else (self.evaluation or self.training)
        self._standing_in = self.ordered and with_grad
        self._at = 0
        self._visits = []

    def first(self) -> Unit | None:
        """The unit to prefetch as the root's forward begins."""
        return self._now.units[0] if self._now.learned else None

    def enter(self, unit: Unit) -> Unit | None:
        """`unit`'s forward begins: stand in for the skipped units before it; returns the unit to prefetch."""
        i = self._now.pos.get(id(unit))
        self._ran_since_backward.add(id(unit))
        if i is None or i < self._at:
            self._visits.append((unit, True))
            return None  # run again, or not in the schedule: gathered on demand
        if self._standing_in:
            for j in range(self._at, i):
                self._stand_in_forward(j)
        self._visits.append((unit, True))
        self._at = i + 1
        return self._now.after(i)

    def end_forward(self, *, with_grad: bool) -> None:
        """The root's forward ended: stand in for the units the schedule has left."""
        if self._standing_in:
            for j in range(self._at, len(self._now.units)):
                self._stand_in_forward(j)
        self._at = len(self._now.units)
        self._unlearned = (with_grad, list(self._visits))
        if with_grad:
            self._forwards_since_backward += 1
            self._last_grad_visits = self._unlearned[1]

    def _stand_in_forward(self, j: int) -> None:
        """What a rank running the unit at `j` issues on entering it: its gather, and the prefetch `enter` makes."""
        unit = self._now.units[j]
        unit.wait_gathered()
        nxt = self._now.after(j)
        if nxt is not None:
            nxt.gather()
        unit.release()
        self._visits.append((unit, False))

    # --- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._backward = _first_seen([u for u, _ in reversed(self._last_grad_visits)])
        self._back_pos = {id(u): i for i, u in enumerate(self._backward)}
        self._back_at = 0
        self._back_seen = set()

    def reach(self, unit: Unit) -> Unit | None:
        """`unit`'s backward begins: pass the units after it; returns the unit to prefetch."""
        self._back_seen.add(id(unit))
        i = self._back_pos.get(id(unit))
        if i is None or i < self._back_at:
            return None
        self._pass_until(i)
        self._back_at = i + 1
        return self._backward[i + 1] if i + 1 < len(self._backward) else None

    def end_backward(self) -> None:
        """Backward is over: pass the units it did not reach."""
        self._pass_until(len(self._backward))
        self._back_at = len(self._backward)
        self._ran_since_backward = set()
        self._forwards_since_backward = 0

    def _pass_until(self, end: int) -> None:
        if not self.ordered:
            return
        for j in range(self._back_at, end):
            unit = self._backward[j]
            if id(unit) not in self._back_seen:  # stand in for its backward's gathers
                unit.wait_gathered()
                if j + 1 < len(self._backward):
                    self._backward[j + 1].gather()
            if self._forwards_since_backward <= 1 or id(unit) not in self._ran_since_backward:
                self._pass_over(unit)
