"""The schema seen as flat dotted keys: `zero.offload_param.device` -> its type, and back to a tree.

Loaders translate a user's keys into these dotted zerofit keys and convert each value on its own;
`build_config` then assembles the frozen dataclasses once, so no loader constructs the tree by hand
and every loader agrees on what a key means.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

from .schema import RunConfig

# Sub-configs that are absent (None) unless the user names one: a key under them creates them.
_OPTIONAL_SECTIONS = ("optimizer", "scheduler")


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass inside `hint` (`X` or `X | None`), or None for a plain value."""
    members = typing.get_args(hint) if typing.get_origin(hint) is not None else (hint,)
    for member in (hint, *members):
        if isinstance(member, type) and dataclasses.is_dataclass(member):
            return member
    return None


def _leaves(cls: type, prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        sub = _dataclass_of(hint)
        if sub is not None:
            found.update(_leaves(sub, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = hint
    return found


@functools.cache
def leaf_hints() -> Mapping[str, Any]:
    """Every settable dotted key of RunConfig and its resolved annotation."""
    return _leaves(RunConfig, "")


def hint_of(key: str) -> Any:
    return leaf_hints()[key]


def build_config(values: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from converted values keyed by dotted zerofit keys; unnamed keys keep defaults.

    `optimizer`/`scheduler` come into being only when one of their keys is given; giving one without
    its `type` is the caller's problem to report (it is filled with "" here so building succeeds).
    """
    nested: dict[str, Any] = {}
    for key, value in values.items():
        node = nested
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    for section in _OPTIONAL_SECTIONS:
        if isinstance(nested.get(section), dict):
            nested[section].setdefault("type", "")
    return _construct(RunConfig, nested)


def _construct(cls: type, data: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _dataclass_of(hints[name])
        kwargs[name] = _construct(sub, value) if sub is not None and isinstance(value, Mapping) else value
    return cls(**kwargs)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """The inverse of `build_config`: every leaf of a config tree under its dotted key."""
    found: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.update(flatten(value, f"{prefix}{f.name}."))
        else:
            found[f"{prefix}{f.name}"] = value
    return found
