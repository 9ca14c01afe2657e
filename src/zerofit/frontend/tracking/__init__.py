"""Experiment trackers: `Accelerator(log_with=...)`, `init_trackers`, `log`, `end_training`.

- `base`: the tracker interface (Accelerate's `GeneralTracker`) a script's own tracker object follows;
- `services`: wandb, mlflow, comet_ml, aim, clearml, dvclive, each through its own client library;
- `selection`: what `log_with` asks for, the run's trackers from `init_trackers` to `end_training`, and
  zerofit's own jsonl and TensorBoard trackers.

Scripts import the classes as `zerofit.tracking` spells them (Accelerate's `accelerate.tracking`).
"""
