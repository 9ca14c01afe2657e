"""Backward passes the engine did not start: a script's own `loss.backward()`.

[Note: a backward the engine did not start]
`ZeroEngine.backward(loss)` brackets the autograd pass with bookkeeping: before it, the step mode,
the units and the stage-3 gather order learn that a backward begins and whether it closes the
accumulation window (`sync`); after it, the reductions backward did not launch go out, units are
released, and the window is marked as holding gradients. A script that calls `loss.backward()`
itself (plain PyTorch habit, which Accelerate + DDP trains) runs the engine's autograd hooks all
the same, so the engine knows about that backward from them, not from which function was called:
- the first engine hook that fires while no backward is open - the hook on the model's outputs
  (`BackwardWatch`, registered by every training forward), a stage-3 unit's pre-backward hook, or a
  parameter's post-accumulate-grad hook - opens the backward: the same begin-bookkeeping as
  `ZeroEngine.backward`, with `sync` from the engine's `BackwardCaller` (the Accelerator's
  accumulate()/no_sync() state, exactly what `accelerator.backward` would pass) or, for the engine
  used on its own, from its micro-step count;
- the end-bookkeeping is queued on that autograd pass with `queue_callback` (what DDP and FSDP use
  for the same purpose): autograd runs it once every gradient of the pass has been accumulated,
  before `loss.backward()` returns.
The output hook fires before any gradient of the model is computed, in the outermost backward: a
parameter hook may first fire inside the nested backward of a reentrant activation checkpoint,
whose end would close the engine's backward too early.
What such a backward does differently from `accelerator.backward(loss)`: its gradients are not
divided by `gradient_accumulation_steps` (the script did not ask for it; Accelerate + DDP sums them
too), and under fp16 the loss was not multiplied by the loss scale. The engine then multiplies the
gradients of that backward by the scale as it adds them up in fp32 (compact compute-dtype gradients
are widened to fp32 first), so the window is uniformly scaled and the step's unscaling gives the
true update; an overflow is still an inf there, and the step is still skipped. Only underflow of
small fp16 gradients is not prevented, which the first step says once.
`torch.autograd.grad` accumulates nothing into `.grad`: a pass that will not run any of the
engine's parameters' AccumulateGrad nodes opens nothing (see `accumulates_into`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node, register_multi_grad_hook

from zerofit.engine.stage3 import opaque, tensors_in


@dataclass(frozen=True)
class BackwardCaller:
    """What the engine asks the caller that owns the accumulation state (the Accelerator) around a
    backward the engine did not start (see [Note: a backward the engine did not start])."""

    begins: Callable[[], bool]
    """Called as such a backward begins: whether it closes the accumulation window (may raise to stop it)."""
    ended: Callable[[bool], None]
    """Called once it ended, with the `sync` `begins` returned."""


def accumulate_nodes(params: list[nn.Parameter]) -> list[Node]:
    """The AccumulateGrad node of each parameter, kept alive so that it is the one backward runs (as DDP
    keeps them); building the view reads no data, so a released stage-3 parameter is fine."""
    with torch.enable_grad():
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in params]


def accumulates_into(nodes: list[Node]) -> bool:
    """Whether the backward pass under way will accumulate a gradient into any of these parameters.

    `loss.backward()` runs every node it reaches (True); `backward(inputs=...)` only those it names;
    `torch.autograd.grad` accumulates into no `.grad`, and torch answers that by raising for a leaf's
    node - the one way torch tells the two apart, so the error means False here."""
    try:
        return any(torch._C._will_engine_execute_node(n) for n in nodes)
    except RuntimeError:  # "...we are currently running autograd.grad()"
        return False


def at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the autograd pass under way has finished (called from inside one of its hooks)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class BackwardWatch:
    """Notices a backward the engine did not start from the first engine hook it fires and opens it
    (see [Note: a backward the engine did not start])."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], *, in_backward: Callable[[], bool],
                 begin: Callable[[bool | None], None], end: Callable[[], bool]):
        """`begin(sync)` and `end() -> sync`: the engine's bookkeeping around a backward (`sync` None: the
        engine counts the micro-step itself)."""
        self.model = model
        self.nodes = accumulate_nodes(params)
        self._in_backward = in_backward
        self._begin = begin
        self._end = end
        self._handle = None
        self.caller: BackwardCaller | None = None
        """Says whether such a backward closes the window (the Accelerator sets it at prepare); None: the
        engine counts micro-steps for it as for `ZeroEngine.backward(loss)` without `sync`."""
        self.unscaled_fp16 = False
        """A backward under fp16 loss scaling ran with an unscaled loss (the engine sets it)."""
        self._warned = False

    def install(self) -> None:
        if self.nodes:  # a frozen model accumulates nothing: nothing to notice
            self._handle = self.model.register_forward_hook(opaque(self._after_forward))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_forward(self, _module: nn.Module, _args: Any, out: Any) -> None:
        if self._in_backward() or not torch.is_grad_enabled():
            return  # recomputation inside backward, or a forward no backward follows
        needs_grad = [t for t in tensors_in(out) if t.requires_grad]
        if needs_grad:
            register_multi_grad_hook(needs_grad, lambda _grads: self.notice(), mode="any")

    def notice(self, *, accumulating: bool = False) -> None:
        """An engine hook fired inside a backward pass; `accumulating`: it is a post-accumulate-grad hook."""
        if self._in_backward():
            return
        if accumulating or accumulates_into(self.nodes):
            self._open()

    def _open(self) -> None:
        self._begin(self.caller.begins() if self.caller is not None else None)
        at_end_of_backward(self._close)

    def _close(self) -> None:
        sync = self._end()
        if self.caller is not None:
            self.caller.ended(sync)

    def warn_if_unscaled(self) -> None:
        """At a step: say once that a backward ran under fp16 without loss scaling."""
        if self.unscaled_fp16 and not self._warned:
            self._warned = True
            warnings.warn("fp16: the script called loss.backward() itself, so the loss was not multiplied by the "
                          "loss scale: zerofit scaled those gradients afterwards, so the update is the right one, "
                          "but gradients too small for fp16 became 0 in backward (underflow); call "
                          "accelerator.backward(loss) (engine.backward(loss)) to scale the loss, or use bf16; "
                          "this warning is shown once", stacklevel=4)
