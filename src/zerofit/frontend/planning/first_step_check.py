"""The first optimizer step of a planned run, measured: does the setting `auto` chose fit as estimated?

[Note: the probe]
When the planner resolved an "auto" at prepare() (`zerofit.frontend.planning.auto_plan`), the run's first optimizer
step is the probe:
- at prepare(), once the engine holds the model, CUDA's peak-memory counter is reset (`start`), so
  the peak it reports next covers the persistent states plus one whole step - forward, backward and
  the first optimizer step, which is where the optimizer states are allocated;
- after that step (`check`, called once by the optimizer wrapper) the peak, the largest over the
  ranks (one all-reduce, once), is held against the estimate and against the bytes the planner's
  headroom rule allows this setting (`Budget.gpu_allowance`); the main process prints one line;
- when the peak leaves less headroom than the planner demanded, a warning says so and names the
  next slower setting that would fit with the bytes the estimate missed, in the keys of the user's
  config file. The run goes on with the setting it has: a switch mid-run would rebuild the engine
  and its state behind the script's back, and a warning the user acts on is clearer than that;
- then the hook is gone: later steps do not pay for it.
Without CUDA there is nothing to measure (`measure` is None) and the probe stays silent; tests give
it a `measure` that returns the peak they want to see judged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerofit.distributed.failures import named
from zerofit.plan.choose import Budget, Plan
from zerofit.plan.first_step_verdict import Verdict, judge


class StepProbe:
    """The probe of one planned model (see the module note): `start` at prepare(), `check` after the first step."""

    def __init__(self, result: Plan, budget: Budget, *, device: torch.device, world: int, is_main: bool,
                 spell: Callable[[str], str] = str):
        self.result, self.budget, self.device = result, budget, device
        self.world, self.is_main, self.spell = world, is_main, spell
        self.engine: Any = None
        """The engine of the planned model: its optimizer's first step is the probe."""
        self.measure: Callable[[], int] | None = None
        """Peak device bytes since `start` (None: nothing to measure, the probe stays silent)."""
        if device.type == "cuda":
            self.measure = lambda: torch.cuda.max_memory_allocated(device)
        self.verdict: Verdict | None = None

    def start(self, engine: Any) -> None:
        self.engine = engine
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def check(self) -> None:
        """Judge the peak of the first step; prints on the main process. Every rank calls it once, alike."""
        if self.measure is None:
            return
        peak = int(self.measure())
        if self.world > 1 and dist.is_initialized():
            value = torch.tensor([float(peak)], dtype=torch.float64,
                                 device=self.device if self.device.type == "cuda" else "cpu")
            with named("all_reduce of the first step's memory peak (stage: auto)", dist.get_rank()):
                dist.all_reduce(value, op=dist.ReduceOp.MAX)  # once per run: the tightest rank decides
            peak = int(value.item())
        self.verdict = judge(peak, self.result, self.budget, spell=self.spell)
        if self.is_main:
            print(self.verdict.line, flush=True)
            if self.verdict.warning:
                print(self.verdict.warning, file=sys.stderr, flush=True)
