"""The planner: what a run costs in memory per setting, which setting to run, and out-of-memory back-off.

- `sources`: a model without data (fake tensors) from a config file, a config class with sizes, or a name;
- `activations`: the activation peak of one micro-step, measured on that model;
- `memory`: the bytes of every engine buffer per setting, from the engine's own layout functions;
- `choose`: every setting's estimate and the fastest that fits a memory budget;
- `auto`: `stage: auto` / offload `auto` resolved at `prepare()`;
- `probe`: the first optimizer step of a planned run, its measured peak against the estimate;
- `backoff`: a CUDA out-of-memory error in a step halves the micro-batch and doubles accumulation;
- `advice`: the estimate for the running model, for the error when nothing more can be done.
"""

from zerofit.plan.choose import Budget, Plan, machine_budget, plan
from zerofit.plan.memory import Estimate, ModelCounts, Setting, Workload, estimate

__all__ = ["Budget", "Estimate", "ModelCounts", "Plan", "Setting", "Workload", "estimate", "machine_budget", "plan"]
