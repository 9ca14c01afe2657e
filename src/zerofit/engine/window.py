"""`AccumulationWindow`: how many micro-steps make one optimizer step, and how far the current one is.

One object, shared: the engine divides each loss by `steps` and (used on its own) counts micro-steps
in it; the Accelerator's `GradientState` holds the same object and counts them there instead, the
out-of-memory back-off changes `steps` in it, and checkpoints save `micro_step` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofit.errors import EngineError


@dataclass
class AccumulationWindow:
    steps: int = 1
    """Micro-steps (backward passes) per optimizer step."""
    micro_step: int = 0
    """Micro-steps since the window last closed."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "steps" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EngineError(f"gradient_accumulation_steps must be a whole number >= 1 (got {value!r}): "
                              "pass 1 for no accumulation")
        super().__setattr__(name, value)


class InWindow:
    """An attribute that reads and writes `owner.window.<field>` (the engine's and `GradientState`'s
    `gradient_accumulation_steps` and `micro_step`: one value, kept in the shared window)."""

    def __init__(self, field: str):
        self.field = field

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.window, self.field)

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(owner.window, self.field, value)
