"""Turning one value, as a YAML or JSON file spells it, into the type a schema field declares.

Config files in the wild write `"true"` for booleans, `1e9` or `"5e8"` for integers and `"auto"`
for values the script fills in. Every loader accepts those spellings the same way, so the rules live
here once. A converter raises `BadValue` with the rule that was broken; the caller adds the key name
(in the user's own naming) and records the problem instead of stopping at the first one.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from .schema import AUTO, is_auto


class BadValue(ValueError):
    """A value that cannot become the declared type; the message reads after the key name."""


_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise BadValue(f"must be true or false (got {_shown(value)})")


def to_int(value: Any) -> int:
    """Integers written as 5e8, 5.0e8 or "5e8" are common in DeepSpeed configs; accept them when whole."""
    if isinstance(value, bool):
        raise BadValue(f"must be a whole number, not a boolean (got {value})")
    if isinstance(value, int):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
    if number is None or not math.isfinite(number) or not number.is_integer():
        raise BadValue(f"must be a whole number (got {_shown(value)}): write it like 500000000 or 5e8")
    return int(number)


def to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise BadValue(f"must be a number, not a boolean (got {value})")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise BadValue(f"must be a number (got {_shown(value)})")


def to_str(value: Any) -> str:
    """Numbers become text too: YAML reads `gpu_ids: 0` or an IP-less hostname as a number."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise BadValue(f"must be text (got {_shown(value)})")


def to_choice(value: Any, choices: tuple[Any, ...]) -> Any:
    """One of a fixed set; text is matched without regard to case (`CPU` and `cpu` both work)."""
    if value is False and "no" in choices:
        return "no"  # YAML 1.1 reads an unquoted `no` (as in `mixed_precision: no`) as false
    if isinstance(value, str):
        for choice in choices:
            if isinstance(choice, str) and choice.lower() == value.strip().lower():
                return choice
    elif value in choices:
        return value
    listed = ", ".join(_shown(c) for c in choices)
    raise BadValue(f"must be one of {listed} (got {_shown(value)})")


def to_str_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise BadValue(f"must be a list of names (got {_shown(value)})")


def with_auto(value: Any) -> Any:
    """A free-form mapping value (optimizer or scheduler params) with "auto" turned into AUTO."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    if isinstance(value, Mapping):
        return {str(k): with_auto(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [with_auto(v) for v in value]
    return value


def to_params(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise BadValue(f"must be a mapping of argument names to values (got {_shown(value)})")
    return with_auto(value)


def is_auto_text(value: Any) -> bool:
    return is_auto(value) or (isinstance(value, str) and value.strip().lower() == "auto")


def convert(value: Any, hint: Any) -> Any:
    """`value` as the type `hint` (a resolved schema annotation) declares, or `BadValue`.

    `Any` inside a union marks a field that may be AUTO; `None` inside one marks a field that may be
    left empty. Everything else is one of the plain kinds the schema uses.
    """
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    allows_auto = Any in members
    allows_none = type(None) in members
    if isinstance(value, str) and value.strip().lower() == "auto" and any(
            typing.get_origin(m) is typing.Literal and "auto" in typing.get_args(m) for m in members):
        return "auto"  # a choice named "auto" (checkpoint.resume), not the AUTO placeholder
    if is_auto_text(value):
        if allows_auto:
            return AUTO
        raise BadValue('cannot be "auto" here: write the value itself')
    if value is None:
        if allows_none:
            return None
        raise BadValue("must not be empty (null): write a value or remove the key")
    kinds = [m for m in members if m is not Any and m is not type(None)]
    if len(kinds) != 1:
        raise TypeError(f"schema annotation {hint!r} is not one zerofit's loaders understand")
    try:
        return _convert_kind(value, kinds[0])
    except BadValue as bad:
        if allows_auto:
            raise BadValue(f'{bad}; or "auto" to let zerofit fill it') from None
        raise


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _convert_kind(value: Any, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        return to_choice(value, typing.get_args(kind))
    if origin is tuple:
        return to_str_tuple(value)
    if origin is dict:
        return to_params(value)
    simple = {bool: to_bool, int: to_int, float: to_float, str: to_str}
    if kind in simple:
        return simple[kind](value)
    raise TypeError(f"schema type {kind!r} is not one zerofit's loaders understand")
