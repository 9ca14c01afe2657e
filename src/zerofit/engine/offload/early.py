"""`EarlyStart`: when an offload part may begin a window's update during backward, and what keeps it exact.

[Note: updates during backward]
When the step's gradient factor is known before backward ends - no clipping, no fp16 loss scale and
no skip_nonfinite_steps, so the factor is exactly 1 - an offloaded group's update can start as soon as
its reduced gradient is final, overlapping the rest of backward: the host-stepped part hands the group
to its CPU worker (zerofit.engine.offload.host), the GPU-stepped part to its issuing thread, which
streams the group's state through the device while backward computes (zerofit.engine.offload.gpu).
The update is the same, bit for bit: same gradients, same factor, same settings.

Four things a script could still do would change the update, or what it sees of it, after the fact, so a
part only starts early once it has seen a whole step without them:
- calling clip_grad_norm_: from then on never early; a first call in a window that already started
  raises if clipping would bite (the update is applied), and returns the norm if it would not (a call with
  max_norm inf only measures the norm, as Trainer does without clipping: it changes nothing);
- changing lr & co. between backward and step(): detected at step() (the early groups used the
  values of when backward ended), warned, and never early again;
- running backward again after the backward that closed the window: never early again; in a window
  that already started it raises (the update is applied without the second backward's gradients);
- running or reading the model between that backward and step() (a forward, a state_dict): never early
  again; in a window that already started it raises, as the started units would show their new weights
  where PyTorch shows the old ones.
Only units all of whose parameters got a gradient in that backward start early; the others step in
step(), which knows which parameters no rank gave a gradient (see [Note: parameters without a
gradient] in zerofit.engine.unused_params). With clipping, the factor needs every gradient, so no
update can start before backward ends without being speculative (see below).

[Note: clipping and the overlapped step]
Without clipping the GPU-stepped groups stream during backward (above). With clipping the factor
c = min(1, max_norm / norm) needs every gradient, and no exact part of the update can run before it: Adam's
moments take c * g and c^2 * g^2. Uploads do not depend on c, but the link carries as many bytes down as up
and downloads need the update, so uploading early would shorten only the stream's head, by one chunk. The
way past it is speculation (DeepSpeed's SuperOffload): step with c = 1 during backward and keep the step only
if the norm says clipping did not bite (c is then exactly 1.0 and torch's clip multiplies by 1.0: the same
update), else step again from the old state. That needs the old state and master kept until the verdict: a
second host home for every speculated group (the master's 2.125 and the 8-bit state's 2.5 bytes per element
again; the master's home must become two packed buffers that swap, as the optimizer's parameters are views
of the fp32 one), its old parameters on the device (2 bytes per element) and the scalar state held back; and
it gains only on the steps where clipping does not bite (`benchmarks/state_quality_report.py` reports that
share for a run). Not built yet.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable

import torch

from zerofit.engine.comm import Pending
from zerofit.engine.flat_group import FlatGroup
from zerofit.engine.unit import Unit
from zerofit.errors import EngineError


class EarlyStart:
    """One offload part's bookkeeping for updates started during backward (see the note).

    The part calls `begin_backward`, `offer` (per reduced unit), `ready` (groups it may hand over now),
    `clip_requested`, `begin_step`, `check_settings`, `zero_grad` and `discard` from its hooks."""

    def __init__(self, off: str | None, what: str):
        """`off`: why this part may never start early (None: it may); `what`: the part's steps, for messages."""
        self.off = off
        self.what = what
        self.now = False
        """This backward closes the window and hands groups over as their gradients arrive."""
        self.started: set[int] = set()
        """Groups whose update for this window was handed over during backward."""
        self.settings: list[dict] | None = None
        """The optimizer settings the early updates of this window used (checked again at step())."""
        self._offered: deque[tuple[list[Pending], list[FlatGroup]]] = deque()
        """Early updates waiting for their gradient reduction to be issued, in reduction order."""
        self.steps_taken = 0
        self._clip_seen = False
        self._window_closed = False
        """A backward closed this window and no step or zero_grad followed yet."""
        self._in_backward = False

    def begin_backward(self, sync: bool) -> None:
        if self._window_closed:  # a second backward after the one that closed the window, before step()
            if self.started:
                raise EngineError(
                    f"backward ran again after the backward that closed accumulation window {self.steps_taken + 1}, "
                    f"and zerofit had already applied that window's update to offloaded state during it ({self.what}): "
                    "call backward once per optimizer step from the first step on (sum the losses, or run "
                    "the earlier backward calls under accelerator.no_sync() / accelerator.accumulate()), "
                    "or set gradient_clipping in the config (then no update starts during backward)")
            self.off = "backward runs more than once per optimizer step"  # quietly: same results
        self._window_closed = sync
        self._in_backward = True
        self.now = sync and self.off is None and self.steps_taken > 0 and not self._clip_seen

    def end_backward(self) -> None:
        self._in_backward = False

    def used(self) -> None:
        """The model is about to be run or read (a unit's parameters are needed): between the backward that closed
        the window and step(), never early again, and an error if this window started."""
        if not self._window_closed or self._in_backward:
            return
        if self.started:
            raise EngineError(
                f"the model was run or read between backward and optimizer.step() in accumulation window "
                f"{self.steps_taken + 1}, after zerofit had already applied part of that window's update during "
                f"backward ({self.what}): that forward would see new weights where PyTorch shows the old ones. "
                "From the first step on, run it before backward or after step() (several losses: sum the losses "
                "and call backward once, or run the earlier backward calls under accelerator.no_sync() / "
                "accelerator.accumulate()), or set gradient_clipping in the config (then no update starts during "
                "backward)")
        self.off = "the model runs between backward and step()"  # quietly: same results

    def offer(self, unit: Unit, pendings: list[Pending], groups: list[FlatGroup]) -> None:
        """`unit`'s reductions were launched: its `groups` (this part's) start once those are issued. Only a
        unit all of whose parameters got a gradient here starts early: none of them can be left out."""
        if self.now and groups and unit.all_reported:
            self._offered.append((pendings, groups))

    def ready(self, settings: Callable[[], list[dict]]) -> list[FlatGroup]:
        """The offered groups whose reductions have been issued, in order, now marked started (`settings()`:
        the optimizer's current settings, taken at the window's first start)."""
        out: list[FlatGroup] = []
        while self._offered and all(p.done for p in self._offered[0][0]):
            out += self._offered.popleft()[1]
        if out:
            if self.settings is None:
                self.settings = settings()
            self.started.update(id(g) for g in out)
        return out

    def clip_requested(self, max_norm: float, norm: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """`clip_grad_norm_` was called: from now on never early. In a window that already started: the norm
        (`norm()`, once the started updates are done) when clipping would not bite, else an error. A max_norm of
        inf is a measurement, not a clip (transformers' Trainer logs the norm so when max_grad_norm is 0): it never
        bites, so it leaves updates starting early."""
        if max_norm == float("inf"):
            return norm() if self.started else None
        self._clip_seen = True
        if not self.started:
            return None
        value = norm()
        if max_norm > 0 and float(value) > max_norm:
            raise EngineError(
                f"clip_grad_norm_(max_norm={max_norm}) was first called at optimizer step {self.steps_taken + 1}, "
                f"after zerofit had already applied this step's update during backward ({self.what}; "
                f"gradient norm {float(value):.4g}): "
                f"set gradient_clipping: {max_norm} in the config (zerofit then clips inside every step), or call "
                "clip_grad_norm_ from the first step on")
        return value

    def begin_step(self) -> bool:
        """`step()` starts: True when this window's update started during backward."""
        self.steps_taken += 1
        return bool(self.started)

    def check_settings(self, current: list[dict], *, stacklevel: int) -> list[dict]:
        """At step() of a window that started early: the settings the rest of it must use (the early ones);
        warns and stops early starts if the script changed them since."""
        if not same_settings(current, self.settings):
            self.disable("the optimizer's settings (lr & co.) changed between backward and step(); "
                         "this step used the values they had when backward ended", stacklevel=stacklevel + 1)
        settings, self.settings = self.settings, None
        self.started = set()
        return settings

    def disable(self, reason: str, *, stacklevel: int) -> None:
        if self.off is None:
            warnings.warn(f"zerofit: {reason}; {self.what} no longer start during backward "
                          "(slower, same results from now on)", stacklevel=stacklevel + 1)
        self.off = reason

    def zero_grad(self) -> None:
        self._window_closed = False

    def discard(self) -> None:
        """The window is thrown away: updates offered but not handed over belong to it."""
        self._offered.clear()
        self.now = False


def offload_off(*, nvme: bool, needs_norm: bool) -> str | None:
    """Why an offload part's updates may never start during backward (None: they may)."""
    if nvme:
        return "NVMe offload"
    if needs_norm:
        return "the step depends on the global gradient norm (clipping, fp16 or skip_nonfinite_steps)"
    return None


def same_settings(a: list[dict], b: list[dict] | None) -> bool:
    """Param-group settings equal value for value (lr may be a tensor)."""
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return b is not None and len(a) == len(b) and all(
        ga.keys() == gb.keys() and all(same(ga[k], gb[k]) for k in ga) for ga, gb in zip(a, b))


def current_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's settings (lr & co.) of every param group, as they are now (a tensor lr copied: torch's
    schedulers fill it in place, while the groups are still being stepped on another thread)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in pg.items() if k != "params"}
            for pg in optimizer.param_groups]
