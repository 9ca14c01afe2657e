"""fp16 loss scaling with DeepSpeed's semantics (`zerofit.config.schema.LossScaleConfig`).

Static (`loss_scale > 0`): the scale never changes; a step whose gradients overflow is skipped.
Dynamic (`loss_scale == 0`): start at 2**initial_scale_power; on an overflow, spend one unit of
hysteresis, and once it is spent halve the scale (never below min_loss_scale); after
`loss_scale_window` overflow-free steps since the last overflow, double the scale and refill the
hysteresis. With consecutive_hysteresis the hysteresis refills on every overflow-free step instead.
Overflowing while already at the minimum scale raises `LossScaleError`: training cannot go on usefully.
"""

from __future__ import annotations

from typing import Any

from zerofit.config.schema import LossScaleConfig
from zerofit.errors import LossScaleError


class LossScaler:
    """Holds the current scale; `update(overflow)` after every optimizer step attempt."""

    def __init__(self, config: LossScaleConfig | None, *, enabled: bool):
        self.enabled = enabled
        self.config = config or LossScaleConfig()
        c = self.config
        self.dynamic = enabled and c.loss_scale == 0
        self.scale = float(2 ** c.initial_scale_power) if self.dynamic else (c.loss_scale if enabled else 1.0)
        self.hysteresis = c.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            self.iteration += 1
            return
        c = self.config
        if overflow:
            if c.hysteresis == 1 or self.hysteresis == 1:
                if self.scale <= c.min_loss_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflow at the minimum loss scale {c.min_loss_scale:g} "
                        f"(step {self.iteration}): training cannot continue. Use bf16 "
                        "(mixed_precision: bf16 / \"bf16\": {\"enabled\": true}), lower the learning rate, "
                        "or lower fp16.min_loss_scale.")
                self.scale = max(self.scale / 2, c.min_loss_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if c.consecutive_hysteresis:
                self.hysteresis = c.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % c.loss_scale_window == 0:
                if not c.consecutive_hysteresis:
                    self.hysteresis = c.hysteresis
                self.scale *= 2
        self.iteration += 1

    def get_scale(self) -> float:
        """The current scale (torch's GradScaler spelling, read through `accelerator.scaler`)."""
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "hysteresis": self.hysteresis, "iteration": self.iteration,
                "last_overflow": self.last_overflow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis = int(state["hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])
