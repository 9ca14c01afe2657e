"""`logging.steps_per_print`: one short progress line from the main process every N optimizer steps.

    zerofit: step 200 | lr 0.000291
    zerofit: step 200 | lr 0.000291 | loss scale 32768 | skipped 3      (fp16)

Only a config that sets the key prints (a DeepSpeed file that leaves it out stays quiet, where
DeepSpeed itself would print every 10 steps). `AcceleratedOptimizer.step` calls `after_step` once per
optimizer step; everything it reads is already on the host - the step counter, the first param
group's lr (a Python float unless the script made it a tensor), the loss scale (a float in
`zerofit.engine.loss_scale.LossScaler`) - so the step gains no device synchronisation.
"""

from __future__ import annotations

from typing import Any


def progress_line(step: int, lr: Any, loss_scale: float | None, skipped: int) -> str:
    parts = [f"zerofit: step {step}", f"lr {float(lr):.3g}"]
    if loss_scale is not None:
        parts += [f"loss scale {loss_scale:g}", f"skipped {skipped}"]
    return " | ".join(parts)


class Progress:
    """Counts skipped steps and prints every `every` optimizer steps (on the process that holds one)."""

    def __init__(self, every: int):
        self.every = every
        self.skipped = 0
        """fp16 steps skipped for overflow since this process started."""

    @classmethod
    def for_process(cls, every: int | None, *, is_main: bool) -> Progress | None:
        """A Progress for the main process when the config sets steps_per_print, else None."""
        return cls(every) if every and is_main else None

    def after_step(self, optimizer: Any) -> None:
        """After `optimizer` (an AcceleratedOptimizer) took a step, skipped or not."""
        self.skipped += bool(optimizer.step_was_skipped)
        if optimizer.steps_taken % self.every:
            return
        scaler = optimizer.engine.scaler
        lr = optimizer.optimizer.param_groups[0]["lr"]
        print(progress_line(optimizer.steps_taken, lr, scaler.scale if scaler.enabled else None, self.skipped),
              flush=True)
