"""`logging.steps_per_print`: one short progress line from the main process every N optimizer steps.

    zerofit: step 200 | lr 0.000291 | 52,400 tokens/s | 102 samples/s | MFU 38.5% | GPU peak 61.2 GiB
    zerofit: step 200 | lr 0.000291 | ... | loss scale 32768 | skipped 3                       (fp16)

Only a config that sets the key prints (a DeepSpeed file that leaves it out stays quiet, where
DeepSpeed itself would print every 10 steps). `AcceleratedOptimizer.step` calls `after_step` once per
optimizer step; everything it reads is already on the host - the step counter, the first param
group's lr (a Python float unless the script made it a tensor), the loss scale (a float in
`zerofit.engine.loss_scale.LossScaler`), the rates of `zerofit.frontend.throughput` ([Note: throughput
without a sync]) - so the step gains no device synchronisation. The rates are over the steps since the
previous line; each is left out where it is not known (no token ids, no GPU, no measured matmul rate),
and all of them with `logging.throughput: false`. With trackers started (`init_trackers`), each line's
values also go to `accelerator.log` under `zerofit/` keys (`TRACKER_KEYS`), at the line's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerofit.config.schema import LoggingConfig
from zerofit.engine import ZeroEngine
from zerofit.frontend.throughput import Throughput, Window

GIB = 2**30
TRACKER_KEYS = {
    "tokens_per_s": "zerofit/tokens_per_s",
    "samples_per_s": "zerofit/samples_per_s",
    "mfu": "zerofit/mfu",
    "gpu_peak_gib": "zerofit/gpu_peak_gib",
    "loss_scale": "zerofit/loss_scale",
    "skipped": "zerofit/skipped_steps",
}
"""What each of a line's values is logged as (`mfu` as a fraction, 0 to 1)."""


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def progress_values(window: Window | None, peak_bytes: int | None, loss_scale: float | None,
                    skipped: int) -> dict[str, float]:
    """The line's values beside step and lr, by their `TRACKER_KEYS` name; those not known are left out."""
    out: dict[str, float] = {}
    if window is not None:
        for name in ("tokens_per_s", "samples_per_s", "mfu"):
            if getattr(window, name) is not None:
                out[name] = getattr(window, name)
    if peak_bytes is not None:
        out["gpu_peak_gib"] = peak_bytes / GIB
    if loss_scale is not None:
        out["loss_scale"], out["skipped"] = loss_scale, skipped
    return out


def progress_line(step: int, lr: Any, values: dict[str, float]) -> str:
    """The printed line: step and lr, then `values` (from `progress_values`)."""
    parts = [f"zerofit: step {step}", f"lr {float(lr):.3g}"]
    if "tokens_per_s" in values:
        parts.append(f"{_rate(values['tokens_per_s'])} tokens/s")
    if "samples_per_s" in values:
        parts.append(f"{_rate(values['samples_per_s'])} samples/s")
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    if "gpu_peak_gib" in values:
        parts.append(f"GPU peak {values['gpu_peak_gib']:.1f} GiB")
    if "loss_scale" in values:
        parts += [f"loss scale {values['loss_scale']:g}", f"skipped {values['skipped']}"]
    return " | ".join(parts)


class Progress:
    """Counts skipped steps and prints every `every` optimizer steps (on the process that holds one)."""

    def __init__(self, every: int, *, throughput: Throughput | None = None,
                 log: Callable[[dict[str, Any], int], None] | None = None):
        """`throughput`: the rates to print (None: `logging.throughput: false`); `log(values, step)`: where a
        line's values go as well (`Accelerator.log`, a no-op without trackers)."""
        self.every = every
        self.throughput = throughput
        self.log = log
        self.skipped = 0
        """fp16 steps skipped for overflow since this process started."""

    @classmethod
    def for_process(cls, logging: LoggingConfig, *, is_main: bool, engine: ZeroEngine | None = None,
                    world: int = 1, device: torch.device | None = None,
                    log: Callable[[dict[str, Any], int], None] | None = None) -> Progress | None:
        """A Progress for the main process when the config sets steps_per_print, else None; with the rates of
        `engine`'s model unless `logging.throughput` is off."""
        if not logging.steps_per_print or not is_main:
            return None
        throughput = None
        if logging.throughput and engine is not None:
            throughput = Throughput.for_engine(engine, world=world, device=device or torch.device("cpu"))
        return cls(logging.steps_per_print, throughput=throughput, log=log if throughput is not None else None)

    def after_step(self, optimizer: Any) -> None:
        """After `optimizer` (an AcceleratedOptimizer) took a step, skipped or not."""
        self.skipped += bool(optimizer.step_was_skipped)
        printing = optimizer.steps_taken % self.every == 0
        window = None
        if self.throughput is not None and (printing or not self.throughput.running):
            window = self.throughput.lap()  # the first step's end starts the first window
        if not printing:
            return
        scaler = optimizer.engine.scaler
        lr = optimizer.optimizer.param_groups[0]["lr"]
        scale = scaler.scale if scaler.enabled else None
        peak = self.throughput.peak_bytes() if self.throughput is not None else None
        values = progress_values(window, peak, scale, self.skipped)
        print(progress_line(optimizer.steps_taken, lr, values), flush=True)
        if self.log is not None and values:
            self.log({TRACKER_KEYS[k]: v for k, v in values.items()}, optimizer.steps_taken)
