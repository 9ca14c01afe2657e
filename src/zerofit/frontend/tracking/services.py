"""Trackers that report to an experiment-tracking service through its own client library: wandb, mlflow,
comet_ml, aim, clearml, dvclive.

Each keeps the name, arguments and behaviour Accelerate's tracker of that name has, so a script's
`init_kwargs={"wandb": {...}}` and `log_kwargs` mean the same here: the tracker is built with the project
name (and the logging directory when `requires_logging_directory`), `start()` opens the run,
`store_init_configuration(config)` records the hyperparameters, `log(values, step, **kwargs)` reports,
`finish()` closes. The client library is imported in `start()`, so a script that does not ask for a
service never imports it. `SERVICES` says which module each name needs and which pip package brings it.

Each is tested through the Accelerator in its offline / local mode (tests/test_trackers.py): wandb offline,
MLflow's file store, a comet_ml offline experiment (its zip), an Aim repository in a folder, a ClearML
offline session and DVCLive's files.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerofit.frontend.tracking.base import GeneralTracker, numbers


@dataclass(frozen=True)
class Service:
    module: str
    """What `start()` imports (and what decides whether the service is installed)."""
    pip: str
    """What to install to get it."""


SERVICES = {
    "wandb": Service("wandb", "wandb"),
    "mlflow": Service("mlflow", "mlflow"),  # mlflow-skinny provides the same module
    "comet_ml": Service("comet_ml", "comet_ml"),
    "aim": Service("aim", "aim"),
    "clearml": Service("clearml", "clearml"),
    "dvclive": Service("dvclive", "dvclive"),
}


def _warn_once(seen: set[str], message: str, *, stacklevel: int = 4) -> None:
    if message not in seen:
        seen.add(message)
        warnings.warn(message, stacklevel=stacklevel)


def _metrics(values: dict[str, Any], seen: set[str], why_not: Callable[[str, Any], str]) -> dict[str, int | float]:
    """The numbers among `values` (as `numbers` converts them), for a service whose metrics are numbers only; each
    other value is left out with a warning, once per message (`why_not(key, value)` says it)."""
    out = {}
    for key, value in numbers(values).items():
        if isinstance(value, (int, float)):
            out[key] = value
        else:
            _warn_once(seen, why_not(key, value), stacklevel=5)  # the frame calling the tracker's log
    return out


class WandBTracker(GeneralTracker):
    """A wandb run: `wandb.init(project=<project>, **init_kwargs)`; `tracker` is the `Run`. Offline runs
    (`init_kwargs={"wandb": {"mode": "offline"}}` or `WANDB_MODE=offline`) write under `WANDB_DIR`."""

    name = "wandb"
    requires_logging_directory = False
    main_process_only = False  # Accelerate's value; zerofit builds trackers on the main process only anyway

    def __init__(self, run_name: str, **kwargs: Any):
        self.run_name, self.init_kwargs, self.run = run_name, kwargs, None

    def start(self) -> None:
        import wandb

        self.run = wandb.init(**{"project": self.run_name, **self.init_kwargs})

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(numbers(values), allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(numbers(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment named by MLFLOW_EXPERIMENT_NAME or else the project (created when
    missing, with `logging_dir` as its artifact location); `tracker` is the active `Run`. Where runs are
    stored is MLflow's own setting (MLFLOW_TRACKING_URI). MLFLOW_RUN_ID, MLFLOW_TAGS (JSON) and
    MLFLOW_NESTED_RUN win over the arguments of the same meaning, as in Accelerate. Metrics must be
    numbers: other values are left out with one warning per key."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 run_id: str | None = None, tags: dict[str, Any] | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None):
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested.strip().lower() in ("1", "true", "yes", "on") if isinstance(nested, str) else nested
        self.run_name, self.description = run_name, description
        self.active_run: Any = None
        self._warned: set[str] = set()

    def start(self) -> None:
        import mlflow

        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment is not None else mlflow.create_experiment(
            self.experiment_name, artifact_location=self.logging_dir, tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """As parameters, in batches of MLflow's per-call limit; a value longer than MLflow takes is left out
        with a warning."""
        import mlflow
        from mlflow.utils import validation

        longest = getattr(validation, "MAX_PARAM_VAL_LENGTH", 6000)
        batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        params = []
        for key, value in numbers(values).items():
            if len(str(value)) > longest:
                _warn_once(self._warned, f"mlflow: config value {key!r} is {len(str(value))} characters long, "
                                         f"more than MLflow's {longest} for a parameter, so it is not recorded")
            else:
                params.append((key, value))
        for i in range(0, len(params), batch):
            mlflow.log_params(dict(params[i:i + batch]))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        metrics = _metrics(values, self._warned, lambda key, value: (
            f"mlflow: {key!r} is a {type(value).__name__}, and MLflow metrics are numbers, so it is not recorded "
            "(log a number; mlflow.log_param or mlflow.set_tag take text)"))
        mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(GeneralTracker):
    """A Comet experiment: `comet_ml.start(project_name=<project>, **init_kwargs)` (comet_ml >= 3.41; the
    API key comes from Comet's own config or COMET_API_KEY)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any):
        self.run_name, self.init_kwargs, self.experiment = run_name, kwargs, None
        self._warned: set[str] = set()

    def start(self) -> None:
        import comet_ml

        self.experiment = comet_ml.start(**{"project_name": self.run_name, **self.init_kwargs})

    @property
    def tracker(self) -> Any:
        return self.experiment

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.experiment.log_parameters(numbers(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as metrics, strings as "other" values, a dict as a group of metrics."""
        if step is not None:
            self.experiment.set_step(step)
        for key, value in numbers(values).items():
            if isinstance(value, (int, float)):
                self.experiment.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.experiment.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.experiment.log_metrics(value, step=step, **kwargs)
            else:
                _warn_once(self._warned, f"comet_ml: {key!r} is a {type(value).__name__}, which Comet does not take "
                                         "here, so it is not recorded (log a number, a str or a dict of numbers)")

    def finish(self) -> None:
        self.experiment.end()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at the logging directory, named after the project."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs: Any):
        self.run_name, self.repo, self.init_kwargs, self.run = run_name, str(logging_dir), kwargs, None
        self._warned: set[str] = set()

    def start(self) -> None:
        from aim import Run

        self.run = Run(repo=self.repo, **self.init_kwargs)
        self.run.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run["hparams"] = numbers(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as metrics, text as `aim.Text`, Aim's own objects (`aim.Image`, ...) as they are; anything
        else (which `Run.track` refuses) is left out with one warning per message."""
        from aim import Text
        from aim.storage.object import CustomObject

        for key, value in numbers(values).items():
            if isinstance(value, str):
                value = Text(value)
            elif not isinstance(value, (int, float, CustomObject)):
                _warn_once(self._warned, f"aim: {key!r} is a {type(value).__name__}, which Aim does not track, so "
                                         "it is not recorded (log a number, a str, or an aim object such as aim.Image)")
                continue
            self.run.track(value, name=key, step=step, **kwargs)

    def finish(self) -> None:
        self.run.close()


class ClearMLTracker(GeneralTracker):
    """A ClearML task: the one already running (`Task.current_task()`, left open at the end), or a new
    `Task.init` in project CLEARML_PROJECT / task CLEARML_TASK, each defaulting to the project name.
    A key starting `train_`, `eval_` or `test_` is reported as that series; numbers only."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any):
        self.run_name, self.init_kwargs, self.task, self.external = run_name, kwargs, None, False
        self._warned: set[str] = set()

    def start(self) -> None:
        from clearml import Task

        self.task = Task.current_task()
        self.external = self.task is not None
        if not self.external:
            kwargs = {"project_name": os.environ.get("CLEARML_PROJECT", self.run_name),
                      "task_name": os.environ.get("CLEARML_TASK", self.run_name), **self.init_kwargs}
            self.task = Task.init(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.task

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.task.connect_configuration(numbers(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """With a step, as scalars at that iteration; without one, as single values."""
        logger = self.task.get_logger()
        metrics = _metrics(values, self._warned, lambda key, value: (
            f"clearml: {key!r} is a {type(value).__name__}, not a number, so it is not reported"))
        for key, value in metrics.items():
            if step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                series = next((p for p in ("train", "eval", "test") if key.startswith(p + "_")), None)
                title = key[len(series) + 1:] if series else key
                logger.report_scalar(title=title, series=series or "train", value=value, iteration=step, **kwargs)

    def finish(self) -> None:
        if self.task is not None and not self.external:
            self.task.close()


class DVCLiveTracker(GeneralTracker):
    """A `dvclive.Live(**init_kwargs)` (the project name is not used: DVCLive's own `dir` says where), or
    the `live=` object given in init_kwargs; each `log()` is one DVCLive step."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any):
        self.live, self.init_kwargs = live, kwargs
        self._warned: set[str] = set()

    def start(self) -> None:
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(numbers(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        metrics = _metrics(values, self._warned, lambda key, value: (
            f"dvclive: {key!r} is a {type(value).__name__}, not a number, so it is not logged"))
        for key, value in metrics.items():
            self.live.log_metric(key, value, **kwargs)
        self.live.next_step()

    def finish(self) -> None:
        self.live.end()


CLASSES: dict[str, type[GeneralTracker]] = {
    "wandb": WandBTracker, "mlflow": MLflowTracker, "comet_ml": CometMLTracker, "aim": AimTracker,
    "clearml": ClearMLTracker, "dvclive": DVCLiveTracker,
}
