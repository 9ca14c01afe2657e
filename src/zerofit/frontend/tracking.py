"""Experiment trackers behind `init_trackers` / `log` / `end_training`, main process only.

JSON lines always work (`jsonl`: one object per `log()` call, `{"step": ..., "time": ..., **values}`,
in `<logging_dir>/<project>/metrics.jsonl`); TensorBoard is used when asked for and installed
(`tensorboard`, or `all`). Any other name Accelerate knows (wandb, mlflow, ...) is reported once and
left out, since zerofit does not bundle those integrations.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Any

import torch

KNOWN = ("jsonl", "tensorboard")


class JsonlTracker:
    name = "jsonl"

    def __init__(self, run_name: str, logging_dir: str, config: dict[str, Any] | None):
        self.dir = os.path.join(logging_dir, run_name)
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()
        if config is not None:
            with open(os.path.join(self.dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(_plain(config), f, indent=2, default=str)

    def log(self, values: dict[str, Any], step: int | None) -> None:
        record = {"step": step, "time": time.time(), **_plain(values)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_name: str, logging_dir: str, config: dict[str, Any] | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(os.path.join(logging_dir, run_name))
        if config is not None:
            flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _plain(config).items()}
            self.writer.add_hparams(flat, {}, run_name=".")

    def log(self, values: dict[str, Any], step: int | None) -> None:
        for key, value in _plain(values).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Tensors and numpy scalars as Python numbers (NaN and inf kept as strings JSON can hold)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        out[str(key)] = value
    return out


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def requested(log_with: Any) -> list[str]:
    """Tracker names from `Accelerator(log_with=...)`: a name, a list of names, or "all"."""
    if log_with is None:
        return []
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    names = [str(getattr(n, "value", n)).lower() for n in names]
    if "all" in names:
        return ["jsonl"] + (["tensorboard"] if tensorboard_available() else [])
    return names


def start(names: list[str], run_name: str, logging_dir: str, config: dict[str, Any] | None) -> list[Any]:
    """The trackers for `names` (always including jsonl when any is asked for); unknown ones are warned about."""
    trackers: list[Any] = []
    wanted = list(dict.fromkeys(["jsonl", *names]))
    for name in wanted:
        if name == "jsonl":
            trackers.append(JsonlTracker(run_name, logging_dir, config))
        elif name == "tensorboard":
            if tensorboard_available():
                trackers.append(TensorBoardTracker(run_name, logging_dir, config))
            else:
                warnings.warn("log_with tensorboard: the tensorboard package is not installed, so only the "
                              "JSON lines tracker records this run: pip install tensorboard", stacklevel=3)
        else:
            warnings.warn(f"log_with {name!r} is not a tracker zerofit provides (it has {', '.join(KNOWN)}): "
                          f"metrics go to the JSON lines file in {logging_dir}", stacklevel=3)
    return trackers
