"""The tracker interface `init_trackers` / `log` / `end_training` drive: Accelerate's `GeneralTracker`.

A tracker has a `name` (what `get_tracker(name)` and the keys of `init_kwargs` / `log_kwargs` match),
`requires_logging_directory` (whether it is built with the logging directory), `main_process_only`,
`start()`, `store_init_configuration(values)`, `log(values, step=None, **kwargs)`, `finish()`, and a
`tracker` property: the service's own object (a wandb `Run`, ...), what `get_tracker(name, unwrap=True)`
returns. Subclassing `GeneralTracker` (public as `zerofit.tracking.GeneralTracker`) gives no-op
defaults; a script's own tracker object needs only `name`, `store_init_configuration`, `log` and
`finish` (a subclass of Accelerate's `GeneralTracker` qualifies as it is).
"""

from __future__ import annotations

from typing import Any

import torch

REQUIRED = ("name", "store_init_configuration", "log", "finish")
"""What an object passed in `log_with` must have to be used as a tracker."""


class GeneralTracker:
    """Base class of zerofit's trackers and of a script's own (pass an instance in `log_with`)."""

    name: str
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def start(self) -> None:
        """Open the run (called once by `init_trackers`, after the tracker is built)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters (`init_trackers(config=...)`)."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` at `step`; kwargs are this tracker's entry of `log(log_kwargs=...)`."""

    def finish(self) -> None:
        """Close the run (`end_training`)."""

    @property
    def tracker(self) -> Any:
        return None


class BlankTracker(GeneralTracker):
    """What `get_tracker` gives on a process that has no trackers (every one but the main process): calls
    to it do nothing, so a script may call it on every rank, as with Accelerate."""

    name = ""


def missing_attributes(obj: Any) -> list[str]:
    """What `obj` lacks of the interface a tracker object in `log_with` must have."""
    missing = [] if isinstance(getattr(obj, "name", None), str) and obj.name else ["name (a non-empty str)"]
    return missing + [f"{m}()" for m in REQUIRED[1:] if not callable(getattr(obj, m, None))]


def numbers(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with one-element tensors and numpy scalars as Python numbers, keys as str."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()
        out[str(key)] = value
    return out
