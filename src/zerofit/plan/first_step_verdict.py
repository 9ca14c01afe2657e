"""The judgement of a planned run's first optimizer step: does the setting `auto` chose fit as estimated?

`judge` holds a measured peak against the plan (pure: tests and `zerofit.frontend.planning.first_step_check` call it);
the run-time side - resetting and reading CUDA's peak counter, agreeing over the ranks, printing -
is `zerofit.frontend.planning.first_step_check.StepProbe` (see its note).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zerofit.plan.choose import Budget, Plan
from zerofit.plan.memory import GIB, Estimate, Setting

_KEYS = ("zero.stage", "zero.offload_optimizer.device", "zero.offload_param.device")


@dataclass(frozen=True)
class Verdict:
    """What the probe found: the line every planned run prints, and a warning when the setting is too tight."""

    line: str
    warning: str | None = None
    next_setting: Setting | None = None
    """The slower setting the warning recommends (None: none fits, or no warning)."""


def judge(measured: int, result: Plan, budget: Budget, *, spell: Callable[[str], str] = str) -> Verdict:
    """Hold the measured peak (bytes) of the planned setting against its estimate and the headroom rule.

    `spell` turns a zerofit key into the user's spelling of it (`zerofit.config.naming.key_name`).
    """
    chosen = result.choice or result.smallest
    allowance = budget.gpu_allowance(chosen)
    label = chosen.setting.label
    unknown = "" if chosen.traced else " without activations"
    limit = "unknown" if allowance is None else f"{_gib(allowance)} GiB"
    line = (f"zerofit: probe: measured peak {_gib(measured)} GiB vs estimate {_gib(chosen.gpu_total)} GiB{unknown} "
            f"(budget {limit}) after the first optimizer step under {label}")
    if allowance is None or measured <= allowance:
        return Verdict(line)
    missed = max(0, measured - chosen.gpu_total)
    slower = result.estimates[result.estimates.index(chosen) + 1:]
    fits = [e for e in slower if _fits_with(e, missed, budget)]
    warning = (f"zerofit: WARNING: probe: {label} leaves less than the {budget.headroom:.0%} headroom the planner "
               f"demanded: the first step peaked at {_gib(measured)} GiB, over the {limit} budget (estimate "
               f"{_gib(chosen.gpu_total)} GiB{unknown}). The run goes on with {label}; a longer or larger batch may "
               "run out of memory (the back-off then halves the micro-batch). ")
    if not fits:
        warning += (f"No slower setting fits with the {_gib(missed)} GiB the estimate missed: lower the micro-batch, "
                    "turn on activation checkpointing (model.gradient_checkpointing_enable()) or add GPUs.")
        return Verdict(line, warning)
    best = fits[0]
    warning += (f"To keep the headroom, write the next setting instead of auto: {_written(best.setting, spell)} "
                f"({best.setting.label}, estimate {_gib(best.gpu_total)} GiB + the {_gib(missed)} GiB missed here).")
    return Verdict(line, warning, best.setting)


def _fits_with(e: Estimate, missed: int, budget: Budget) -> bool:
    allowance = budget.gpu_allowance(e)
    return allowance is not None and e.gpu_total + missed <= allowance and budget.host_fits(e) is not False


def _written(s: Setting, spell: Callable[[str], str]) -> str:
    keys, values = list(_KEYS), [s.stage, s.offload_optimizer, s.offload_param]
    if s.offload_optimizer != "none" and s.offload_ratio < 1:
        keys.append("zero.offload_optimizer.ratio")
        values.append(f"{s.offload_ratio:.4g}")
    return ", ".join(f"{spell(k)}: {v}" for k, v in zip(keys, values))


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
