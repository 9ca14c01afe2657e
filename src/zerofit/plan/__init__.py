"""The planner: what a run costs in memory per setting, and which setting to run, offline.

- `sources`: a model without data (fake tensors) from a config file, a config class with sizes, or a name;
- `activations`: the activation peak of one micro-step, measured on that model;
- `memory`: the bytes of every engine buffer per setting, from the engine's own layout functions;
- `choose`: every setting's estimate and the fastest that fits a memory budget;
- `auto`: the decision behind `stage: auto` / offload `auto` / activation checkpointing, the same on every rank;
- `first_step_verdict`: the judgement of a planned run's first optimizer step, its measured peak against the estimate;
- `advice`: the estimate for the running model, for the error when memory runs out.
- `bandwidth`: the machine's offload rates (measured once, cached) and the time model of host-stepped,
  GPU-stepped and split optimizer offload on them;
- `step_time`: what a setting adds to a step on those rates, which ranks the settings that fit.
- `sharing`: those rates as one of several processes on a host may count on them;
- `host_memory`: the host memory a budget holds (`MemTotal`, a cgroup limit) and whether it may grow.

The run-time half lives in the front end (`zerofit.frontend.planning`): `auto_plan` (the budget over the
ranks and the first batch, at `prepare()`), `first_step_check` (measuring the first step) and `backoff` (a
CUDA out-of-memory error halves the micro-batch and doubles accumulation).
"""

from zerofit.plan.choose import Budget, Plan, machine_budget, plan
from zerofit.plan.memory import Estimate, ModelCounts, Setting, Workload, estimate

__all__ = ["Budget", "Estimate", "ModelCounts", "Plan", "Setting", "Workload", "estimate", "machine_budget", "plan"]
