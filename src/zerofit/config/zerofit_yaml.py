"""zerofit's own config format: the schema written plainly, in YAML or JSON.

The file has exactly the shape `schema.to_dict(RunConfig)` produces, and any subset of it: a key
left out keeps its default, "auto" stays AUTO. Because it is the schema itself, the table from the
user's keys to zerofit keys is the identity, and `read(to_dict(cfg))` rebuilds `cfg` exactly; the
launcher relies on that to hand the resolved config to every worker as one JSON file. Fields older
versions had and that never acted (`zero.reduce_bucket_size`, ...) are still read, as
`zerofit.config.ignored` says, so files written then load today.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import yaml

from . import ignored, tree
from .reading import Reading, walk
from .schema import RunConfig, to_dict

SECTIONS = ("launch", "zero", "precision", "batch", "optimizer", "scheduler", "checkpoint", "logging")
"""Top-level sections; any of them (or gradient_clipping) in a file marks it as zerofit's format."""


@functools.cache
def _table() -> dict[str, str]:
    return {key: key for key in tree.leaf_hints()}


def known_paths() -> frozenset[str]:
    """Every dotted key a zerofit file may use (for telling formats apart)."""
    return frozenset((*_table(), *ignored.handled("zerofit")))


def read(data: Mapping[str, Any], source: str | None = None) -> Reading:
    """Every key of a zerofit-format mapping, converted; problems are collected, not raised."""
    reading = Reading(source=source, source_format="zerofit")
    walk(reading, data, table=_table(), handled=ignored.handled("zerofit"))
    ignored.check(reading, data, "zerofit")
    for section in ("optimizer", "scheduler"):
        if isinstance(data.get(section), Mapping) and "type" not in data[section]:
            reading.error(
                f"{section}.type is missing: name the {section} (for example "
                f"{'AdamW' if section == 'optimizer' else 'WarmupLR'}) or remove the {section} section",
                key=f"{section}.type",
            )
    return reading


def dump(config: RunConfig, path: str | os.PathLike[str]) -> None:
    """Write `config` in this format; `.json` gives JSON, anything else YAML."""
    data = to_dict(config)
    data["written"] = list(config.written)  # where a worker learns what the user's file wrote (RunConfig.written)
    with open(path, "w", encoding="utf-8") as f:
        if os.fspath(path).endswith(".json"):
            json.dump(data, f, indent=2)
            f.write("\n")
        else:
            yaml.safe_dump(data, f, sort_keys=False)
