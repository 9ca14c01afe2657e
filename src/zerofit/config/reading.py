"""Reading one user file into dotted zerofit keys while collecting every problem on the way.

Each format module describes itself as a table from the user's dotted key (`zero_optimization.stage`)
to the zerofit key it sets (`zero.stage`), plus the keys it handles by hand. `walk` visits every key
of the file: table keys are converted to the schema type, hand-handled keys are skipped, and anything
else is an unknown key, reported with the closest known spelling. Nothing stops at the first
problem: the loader raises one `ConfigError` with all of them at the end.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import tree
from .coerce import BadValue, convert


class ConfigWarning(UserWarning):
    """A config key zerofit accepts but does not act on, or a deprecated spelling."""


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()
"""What a conversion returns after recording its problem, so callers can skip the value."""


@dataclass
class Reading:
    """The outcome of reading one file: converted values by zerofit key, problems and warnings."""

    source: str | None
    source_format: str
    values: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    invalid: set[str] = field(default_factory=set)
    """zerofit keys whose value was rejected; cross-field checks on them would only repeat the news."""
    written: set[str] = field(default_factory=set)
    """zerofit keys the file gave a value (not those a reader fills in itself): `RunConfig.written`."""

    def error(self, message: str, *, key: str | None = None) -> None:
        self.problems.append(message)
        if key is not None:
            self.invalid.add(key)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def set(self, key: str, value: Any) -> None:
        if value is not INVALID:
            self.values[key] = value

    def coerce(self, name: str, value: Any, to: Callable[[Any], Any], *, key: str | None = None) -> Any:
        """`to(value)`, or INVALID after recording "`name` <rule>" as a problem."""
        try:
            return to(value)
        except BadValue as bad:
            self.error(f"{name} {bad}", key=key)
            return INVALID

    def put(self, key: str, name: str, value: Any) -> None:
        """Convert `value` to the schema type of zerofit `key` and keep it; `name` is the user's key."""
        self.set(key, self.coerce(name, value, lambda v: convert(v, tree.hint_of(key)), key=key))

    def emit_warnings(self) -> None:
        """Warn once per run: in `zerofit launch` (workers then read the resolved zerofit-format file, which
        holds nothing to warn about) and, in a script that loads a file itself, on rank 0 only."""
        if os.environ.get("RANK", "0") != "0":
            return
        where = f" ({self.source})" if self.source else ""
        for message in self.warnings:
            warnings.warn(f"{message}{where}", ConfigWarning, stacklevel=4)


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key(path: str, key: str, known: Iterable[str]) -> str:
    known = sorted(known)
    guess = did_you_mean(key, known)
    if guess is not None:
        parent = path[: len(path) - len(key)]
        return f"{path} is not a known key: did you mean {parent}{guess}? Fix the spelling or remove it"
    shown = ", ".join(known) if len(known) <= 12 else ", ".join(known[:12]) + ", ..."
    return f"{path} is not a known key (known here: {shown}): remove it or fix the spelling"


def _children(paths: Iterable[str]) -> dict[str, set[str]]:
    """For each section prefix ("" for the top), the names allowed directly inside it."""
    children: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for depth, part in enumerate(parts):
            prefix = "".join(p + "." for p in parts[:depth])
            children.setdefault(prefix, set()).add(part)
    return children


def walk(
    reading: Reading,
    data: Mapping[str, Any],
    *,
    table: Mapping[str, str],
    handled: Iterable[str] = (),
    auto_means: Mapping[str, Any] | None = None,
) -> None:
    """Convert every table key found in `data`, and report every key neither tabled nor handled.

    `handled` names user keys (leaves or whole sections) the caller reads itself. `auto_means` gives
    the value that "auto" stands for at load time for some zerofit keys (Accelerate fills those from
    its launch settings, so they are known before the script runs).
    """
    handled = frozenset(handled)
    children = _children([*table, *handled])
    _walk(reading, data, "", table, handled, children, auto_means or {})


def _walk(
    reading: Reading,
    data: Mapping[str, Any],
    prefix: str,
    table: Mapping[str, str],
    handled: frozenset[str],
    children: Mapping[str, set[str]],
    auto_means: Mapping[str, Any],
) -> None:
    for raw_key, value in data.items():
        key = str(raw_key)
        path = f"{prefix}{key}"
        if path in handled:
            continue
        if path in table:
            target = table[path]
            if target in auto_means and isinstance(value, str) and value.strip().lower() == "auto":
                value = auto_means[target]
            reading.put(target, path, value)
            reading.written.add(target)
        elif f"{path}." in children:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                reading.error(f"{path} must be a mapping of keys to values (got {value!r})")
                continue
            _walk(reading, value, f"{path}.", table, handled, children, auto_means)
        else:
            reading.error(unknown_key(path, key, children.get(prefix, ())))


def dig(data: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """The value at dotted `path` in nested mappings, or `default` where any level is missing."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def has(data: Mapping[str, Any], path: str) -> bool:
    marker = object()
    return dig(data, path, marker) is not marker
