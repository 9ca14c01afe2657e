"""The run-time half of the planner (`zerofit.plan` is the offline half): its choices made, checked and undone.

- `auto_plan`: `stage: auto` at `prepare()`: the budget over the ranks, the first batch's shape, the choice printed;
- `first_batch`: a plan made without the batch shape, checked at the first training forward;
- `first_step_check`: the first optimizer step of a planned run, measured against the estimate;
- `backoff`: out-of-memory back-off: halve the micro-batch, double accumulation, replay the window.
"""
