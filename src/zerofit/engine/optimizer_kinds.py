"""Which optimizers may step flat pieces of parameters, and which need each parameter whole.

[Note: elementwise and per-parameter optimizers]
The engine hands an optimizer the pieces of parameters that lie in this rank's shard, as 1-D tensors
(see [Note: one optimizer object] in zerofit.engine.optim). That gives exactly the unsharded result only
when the update of every element depends on that element's own gradient and state alone: Adam, AdamW,
SGD and the other torch optimizers listed in `_ELEMENTWISE`. An optimizer that reads a parameter's shape
or a statistic over the whole tensor - Adafactor (row and column factors of the second moment, the
parameter's RMS), Muon (an orthogonalised matrix update), LAMB-style trust ratios - computes something
else on pieces, so the engine steps each of its parameters whole instead (`PER_PARAMETER`, see [Note:
whole-parameter steps] in zerofit.engine.whole_step). An optimizer of neither list is refused when the
engine is built, naming both ways to declare it: zerofit cannot tell from the outside, and a wrong
guess trains silently wrong.

An optimizer class is known by its `step` function, so a subclass that only changes the constructor
keeps its parent's kind, and one that rewrites `step` must be declared again.
"""

from __future__ import annotations

import torch

from zerofit.errors import EngineError

ELEMENTWISE = "elementwise"
PER_PARAMETER = "per_parameter"

_ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                "ASGD")
"""torch.optim classes whose update of an element reads that element's gradient and state only."""
_PER_PARAMETER = ("Adafactor", "Muon")
"""torch.optim classes whose update reads a parameter's shape or whole-tensor statistics."""
_PER_PARAMETER_ELSEWHERE = ("transformers.optimization.Adafactor",)
"""Per-parameter classes of other libraries, by module and name (nothing is imported to check)."""
_REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure and keeps a history over all parameters; use AdamW",
    "SparseAdam": "it steps sparse gradients, and zerofit's gradients are dense flat shards; use Adam or AdamW",
}

_declared: dict[object, str] = {}
"""step function -> kind, for classes a script declared (`declare_optimizer`)."""


def declare_optimizer(cls: type, kind: str) -> type:
    """Tell zerofit how `cls` updates parameters: "elementwise" (each element from its own gradient and
    state: stepped on flat shards, the fast path) or "per_parameter" (reads a parameter's shape or whole-
    tensor statistics: each parameter stepped whole on one rank). Returns `cls`."""
    if kind not in (ELEMENTWISE, PER_PARAMETER):
        raise ValueError(f"declare_optimizer(kind={kind!r}): use 'elementwise' or 'per_parameter'")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_optimizer expects a torch.optim.Optimizer subclass (got {cls!r})")
    _declared[_unwrapped(cls.step)] = kind
    return cls


def _unwrapped(fn):
    """`fn` without the wrappers torch's Optimizer puts around a class's `step` (profiling, `_use_grad`)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _known(step_fn, names: tuple[str, ...]) -> bool:
    return any(step_fn is _unwrapped(getattr(getattr(torch.optim, n, None), "step", None)) for n in names)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """ELEMENTWISE or PER_PARAMETER for `optimizer`'s class; an EngineError naming the fix for any other."""
    cls = type(optimizer)
    step_fn = _unwrapped(cls.step)
    if step_fn in _declared:
        return _declared[step_fn]
    if _known(step_fn, _ELEMENTWISE):
        return ELEMENTWISE
    if _known(step_fn, _PER_PARAMETER):
        return PER_PARAMETER
    for klass in cls.__mro__:
        if f"{klass.__module__}.{klass.__qualname__}" in _PER_PARAMETER_ELSEWHERE and step_fn is _unwrapped(klass.step):
            return PER_PARAMETER
    name = f"{cls.__module__}.{cls.__qualname__}"
    why = _REFUSED.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if why is not None:
        raise EngineError(f"optimizer {name} is not supported by zerofit: {why}")
    if cls.__module__.split(".")[0] in ("bitsandbytes", "torchao"):
        raise EngineError(f"optimizer {name} keeps block-quantised state that zerofit would cut into other blocks "
                          "on shards, so it is not run: use torch.optim.AdamW (Trainer: --optim adamw_torch) with "
                          "precision.optimizer_state 8bit (Accelerator.prepare() makes that switch itself for "
                          "bitsandbytes' and torchao's 8-bit Adam)")
    raise EngineError(
        f"optimizer {name} is unknown to zerofit, which cannot tell whether its update is elementwise, so it is "
        "not run on sharded pieces (an optimizer that reads a parameter's shape would compute other numbers). "
        "Declare it before prepare(): zerofit.declare_optimizer(" + cls.__name__ + ", 'elementwise') if each "
        "element's update reads only its own gradient and state (fastest), or zerofit.declare_optimizer("
        + cls.__name__ + ", 'per_parameter') to have each parameter stepped whole (always exact for "
        "optimizers that treat parameters one by one)")
