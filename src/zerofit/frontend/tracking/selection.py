"""What `log_with` asks for, and the run's trackers from `init_trackers` to `end_training`.

`log_with` (the Accelerator's argument, or the config's `logging.log_with`) is a name, a tracker object
(zerofit.frontend.tracking.base), or a list of them; "all" means every tracker whose library is installed,
plus the objects given. Names: `jsonl` (zerofit's own, always available: one JSON object per `log()`
call, `{"step": ..., "time": ..., **values}`, in `<logging_dir>/<project>/metrics.jsonl`),
`tensorboard`, and the services of zerofit.frontend.tracking.services. The JSON lines file is written
whenever any tracker is asked for.

An unknown name is an error when the Accelerator is made; a name whose library is not installed is one
error at `init_trackers`, on every process, naming what to install. Trackers run on the main process
only: the others have none, and `get_tracker` gives them a blank one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

from zerofit.config.reading import did_you_mean
from zerofit.errors import ConfigError
from zerofit.frontend.tracking.base import GeneralTracker, missing_attributes, numbers
from zerofit.frontend.tracking.services import CLASSES, SERVICES, Service


class JsonlTracker(GeneralTracker):
    """`<logging_dir>/<project>/metrics.jsonl`, and the config in `config.json` beside it; `tracker` is the
    open file."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str):
        self.dir = os.path.join(logging_dir, run_name)
        self.path = os.path.join(self.dir, "metrics.jsonl")
        self._file: Any = None

    def start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        with open(os.path.join(self.dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(_json_safe(values), f, indent=2, default=str)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": time.time(), **_json_safe(values)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker(GeneralTracker):
    """torch's `SummaryWriter` in `<logging_dir>/<project>` (init_kwargs go to it); `tracker` is the writer."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any):
        self.dir, self.init_kwargs, self.writer = os.path.join(logging_dir, run_name), kwargs, None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(self.dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in numbers(values).items()}
        self.writer.add_hparams(flat, {}, run_name=".")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in numbers(values).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


LIBRARIES: dict[str, Service] = {"tensorboard": Service("tensorboard", "tensorboard"), **SERVICES}
"""The names that need a library, what it is and which pip package brings it."""
BUILDERS: dict[str, type[GeneralTracker]] = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, **CLASSES}
NAMES = tuple(BUILDERS)


def _json_safe(values: dict[str, Any]) -> dict[str, Any]:
    """Numbers as Python numbers, NaN and inf as strings (JSON cannot hold them)."""
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in numbers(values).items()}


def installed(name: str) -> bool:
    """Whether the tracker `name` can start here (its library found; nothing is imported)."""
    if name not in LIBRARIES:
        return True
    module = LIBRARIES[name].module
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec
        return sys.modules.get(module) is not None


def requested(log_with: Any, where: str = "log_with") -> list[str | Any]:
    """The trackers `log_with` asks for: names (lower case, once each) and tracker objects, in order;
    "all" becomes every installed one. `where` names the setting in errors."""
    if log_with is None:
        return []
    given = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[str | Any] = []
    problems = []
    for item in given:
        text = getattr(item, "value", item)  # Accelerate's LoggerType members
        if isinstance(text, str):
            name = text.lower()
            if name == "all":
                chosen += [n for n in NAMES if installed(n)]
            elif name in BUILDERS:
                chosen.append(name)
            else:
                guess = did_you_mean(name, (*NAMES, "all"))
                hint = f"did you mean {guess!r}? " if guess else ""
                problems.append(f"{where}: {text!r} is not a tracker zerofit has; {hint}choose from "
                                f"{', '.join(NAMES)} or 'all', or pass a tracker object")
        elif missing := missing_attributes(item):
            problems.append(f"{where}: {item!r} is not a tracker object: it has no {', '.join(missing)} "
                            "(subclass zerofit.tracking.GeneralTracker, or Accelerate's)")
        else:
            chosen.append(item)
    if problems:
        raise ConfigError(problems)
    return _once(chosen)


def _once(entries: list[str | Any]) -> list[str | Any]:
    """Each name once, each object once (by identity: a tracker object need not be hashable)."""
    kept: list[str | Any] = []
    for entry in entries:
        if not any(entry is k or (isinstance(entry, str) and entry == k) for k in kept):
            kept.append(entry)
    return kept


def check_installed(chosen: list[str | Any]) -> None:
    """One error naming every asked-for tracker whose library is missing, and the pip line that adds them."""
    missing = [name for name in chosen if isinstance(name, str) and not installed(name)]
    if missing:
        packages = " ".join(LIBRARIES[name].pip for name in missing)
        raise ModuleNotFoundError(
            f"log_with asks for {', '.join(missing)}, whose client librar{'ies are' if len(missing) > 1 else 'y is'} "
            f"not installed: pip install {packages} (all six services come with pip install 'zerofit[trackers]'), "
            "or take them out of log_with")


def start(chosen: list[str | Any], project_name: str, logging_dir: str, config: dict[str, Any] | None,
          init_kwargs: dict[str, Any]) -> list[Any]:
    """Build the trackers for `chosen` (jsonl first, always), start them, and store `config` in each:
    Accelerate's order. A name's tracker gets the project name, the logging directory if it requires one,
    and its entry of `init_kwargs`; an object is used as it is."""
    trackers = []
    for entry in _once(["jsonl", *chosen]):
        if not isinstance(entry, str):
            trackers.append(entry)
            continue
        build, kwargs = BUILDERS[entry], dict(init_kwargs.get(entry, {}))
        trackers.append(build(project_name, logging_dir, **kwargs) if build.requires_logging_directory
                        else build(project_name, **kwargs))
    for tracker in trackers:
        if callable(getattr(tracker, "start", None)):
            tracker.start()
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers
