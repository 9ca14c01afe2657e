"""One entry point for every config file: detect the format, read it, apply command-line overrides, validate.

`load_config` tells the three formats apart by the keys only one of them has, not the file name,
because people name Accelerate configs `.json` and DeepSpeed configs `.yaml` alike; only a file whose
keys DeepSpeed and zerofit share is read by its suffix ([Note: telling the formats apart]).
Command-line values, given as dotted zerofit keys, win over the file. Every problem (key
spelling, value type, cross-field rule) comes back in one ConfigError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from . import accelerate_yaml, catalog, deepspeed_json, files, tree, validate, zerofit_yaml
from .reading import Reading, did_you_mean
from .schema import AUTO, RunConfig, is_auto

_ACCELERATE_MARKERS = ("distributed_type", "compute_environment")
_ZEROFIT_MARKERS = ("launch", "zero", "precision", "batch", "logging", "source_format")
# Keys both DeepSpeed and zerofit spell the same way; alone they decide nothing.
_SHARED = frozenset({"optimizer", "scheduler", "gradient_clipping", "checkpoint", "source", "compile"})
_NAMES = {"accelerate": "an Accelerate config", "zerofit": "a zerofit config", "deepspeed": "a DeepSpeed config"}


@dataclass(frozen=True)
class Detected:
    """The format a file is read in, and what decided it (see [Note: telling the formats apart])."""

    kind: str
    """"accelerate", "zerofit" or "deepspeed"."""
    why: str
    """The keys (or, for keys both DeepSpeed and zerofit use, the file's suffix) that decided."""
    by_markers: bool
    """True when keys only that format has decided; False when the suffix broke the tie."""


def _inside(paths: frozenset[str], section: str) -> frozenset[str] | None:
    """The names a format allows directly inside `section` (None: it takes the section whole, any names)."""
    if section in paths:
        return None
    return frozenset(p[len(section) + 1:].split(".")[0] for p in paths if p.startswith(f"{section}."))


def _markers(data: Mapping[str, Any]) -> dict[str, list[str]]:
    """For each format, the file's keys that only that format has: top-level names, and inside a section
    DeepSpeed and zerofit share (`checkpoint.tag_validation` is DeepSpeed's, `compile.mode` zerofit's)."""
    keys = set(map(str, data))
    found = {"accelerate": sorted(keys & set(_ACCELERATE_MARKERS)), "zerofit": sorted(keys & set(_ZEROFIT_MARKERS)),
             "deepspeed": sorted(keys & (deepspeed_json.TOP_LEVEL - _SHARED))}
    for section in sorted(keys & _SHARED):
        value = data[section]
        ours, theirs = _inside(zerofit_yaml.known_paths(), section), _inside(deepspeed_json.KNOWN_PATHS, section)
        if not isinstance(value, Mapping) or ours is None or theirs is None:
            continue
        names = set(map(str, value))
        found["zerofit"] += [f"{section}.{n}" for n in sorted(names & (ours - theirs))]
        found["deepspeed"] += [f"{section}.{n}" for n in sorted(names & (theirs - ours))]
    return {kind: names for kind, names in found.items() if names}


def decide_format(data: Mapping[str, Any], *, suffix: str = "") -> Detected:
    """The format of a parsed file, from what the file is; ConfigError when it is none or several.

    [Note: telling the formats apart]
    Keys only one format has decide: `distributed_type` / `compute_environment` an Accelerate config,
    zerofit's sections (`launch`, `zero`, `precision`, `batch`, `logging`) a zerofit config, DeepSpeed's
    own keys (`zero_optimization`, `train_batch_size`, `fp16`, ...) a DeepSpeed config, and so do the
    names inside a section both have that only one of them knows (`compile.mode`, `checkpoint.resume`
    zerofit's; `checkpoint.tag_validation` DeepSpeed's), whatever the suffix (Accelerate writes JSON
    configs too, and zerofit's launcher hands its workers zerofit JSON).
    Keys of two formats are refused, naming both. A file with only keys DeepSpeed and zerofit share
    (`optimizer`, `scheduler`, `gradient_clipping`, `checkpoint`, `compile`) is read by its suffix: a
    `.json` file as DeepSpeed's (its format is JSON), any other as zerofit's (its format is YAML); the
    error of such a file then says which format was assumed and why. Never "whichever reader finds fewer
    problems": a mistake in a zerofit `compile` section once made its file a DeepSpeed config that
    ignores `compile`, with no word said.
    """
    keys = set(map(str, data))
    found = _markers(data)
    if len(found) > 1:
        shown = "; ".join(f"{', '.join(names)} only in {_NAMES[kind]}" for kind, names in found.items())
        fix = "keep the keys of the format the file is written in and remove or rename the others"
        if "accelerate" in found and "deepspeed" in found:
            fix += " (an Accelerate config names its DeepSpeed file in deepspeed_config.deepspeed_config_file)"
        raise ConfigError([f"cannot tell the config format: the file mixes two ({shown}): {fix}"])
    if found:
        ((kind, names),) = found.items()
        return Detected(kind, f"{', '.join(names)} only in {_NAMES[kind]}", True)
    if keys and keys <= _SHARED:
        kind = "deepspeed" if suffix == ".json" else "zerofit"
        shared = ", ".join(sorted(keys))
        why = (f"its keys ({shared}) are ones DeepSpeed and zerofit share, and it is "
               + ("a .json file (DeepSpeed's format is JSON)" if kind == "deepspeed"
                  else f"{'a ' + suffix if suffix else 'not a .json'} file (zerofit's format is YAML)"))
        return Detected(kind, why, False)
    raise ConfigError(
        [
            f"cannot tell the config format from its keys ({', '.join(sorted(keys))}): an Accelerate config has "
            "distributed_type, a DeepSpeed config zero_optimization or train_batch_size, a zerofit config "
            "launch / zero / precision / batch sections"
        ]
    )


def detect_format(data: Mapping[str, Any], *, suffix: str = "") -> str:
    """ "accelerate", "zerofit" or "deepspeed", from what the parsed file is (`decide_format`)."""
    return decide_format(data, suffix=suffix).kind


def _parse(path: Path) -> Any:
    try:
        return files.load(path, as_json=path.suffix == ".json")
    except files.BadFile as bad:
        raise ConfigError([f"config file {bad}"], str(path) if str(path) not in ("", ".") else None) from None
    except FileNotFoundError:
        raise ConfigError(
            [f"config file {str(path)!r} does not exist: check the path given to --config_file"]
        ) from None
    except (json.JSONDecodeError, yaml.YAMLError) as bad:
        raise ConfigError(
            [f"config file is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {bad}"], str(path)
        ) from None


Settle = Callable[[RunConfig], Mapping[str, Any]]
"""More overrides computed from the config as read (the file and `overrides`), before its rules are checked."""


def load_config(
    path: str | os.PathLike[str] | None, *, overrides: Mapping[str, Any] | None = None,
    settle: Settle | None = None,
) -> RunConfig:
    """The RunConfig in the file at `path` (None: defaults), with `overrides` applied and validated.

    `overrides` maps dotted zerofit keys to command-line values (`{"launch.num_processes": 2}`); a None
    value means the flag was not given. Warnings about accepted-but-ignored keys go through `warnings`.
    `settle(draft)`: more overrides from the config as read, before the cross-field rules are checked and
    only where it was read without problems (`zerofit launch` derives a cluster's machine settings this
    way, some of which a rule needs: the file is read, and warns, once).
    """
    if path is None:
        return config_from_dict({}, overrides=overrides, settle=settle)
    path = Path(path)
    data = _parse(path)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            [f"a config file must hold a mapping of keys to values (got {type(data).__name__})"], str(path)
        )
    return config_from_dict(
        data, overrides=overrides, source=str(path), base_dir=path.parent, suffix=path.suffix, settle=settle
    )


def config_from_dict(
    data: Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | None = None,
    source: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    suffix: str = "",
    settle: Settle | None = None,
) -> RunConfig:
    """`load_config` for an already parsed file; `config_from_dict(to_dict(cfg)) == cfg`."""
    try:
        detected = decide_format(data, suffix=suffix) if data else Detected("zerofit", "it is empty", True)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None
    kind = detected.kind
    if kind == "accelerate":
        reading = accelerate_yaml.read(data, source, base_dir=base_dir)
    elif kind == "deepspeed":
        reading = deepspeed_json.read(data, source)
    else:
        reading = zerofit_yaml.read(data, source)
    _apply_overrides(reading, overrides or {})
    _canonical_types(reading)
    _auto_stage_opens_offload(reading)
    if kind != "zerofit" or "source_format" not in data:
        reading.values["source_format"] = reading.source_format
    if kind != "zerofit" or "source" not in data:
        reading.values["source"] = reading.source
    if kind != "zerofit" or "written" not in data:  # a worker's file keeps what the user's file wrote
        reading.values["written"] = tuple(sorted(reading.written - {"source", "source_format", "written"}))
    reading.emit_warnings()
    if settle is not None and not reading.problems:
        _apply_overrides(reading, settle(tree.build_config(reading.values)))
    config = tree.build_config(reading.values)
    problems = reading.problems + list(
        validate.messages(validate.find_problems(config), skip_keys=reading.invalid)
    )
    if problems:
        where = reading.source
        if not detected.by_markers:  # a guess from the suffix: say which, so a misread file is seen as one
            where = f"{where or 'the config'}, read as {_NAMES[kind]} since {detected.why}"
        raise ConfigError(problems, where)
    return config


def _apply_overrides(reading: Reading, overrides: Mapping[str, Any]) -> None:
    leaves = tree.leaf_hints()
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in leaves:
            guess = did_you_mean(key, leaves)
            hint = (
                f"did you mean {guess}?"
                if guess
                else "overrides use dotted zerofit keys such as launch.num_processes"
            )
            reading.error(f"command-line override {key} is not a zerofit key: {hint}")
            continue
        reading.invalid.discard(key)
        reading.put(key, f"command-line value for {key}", value)
        reading.written.add(key)


def _canonical_types(reading: Reading) -> None:
    """Spell optimizer and schedule types the canonical way (`adamw` -> AdamW), as DeepSpeed matches them."""
    kind = reading.values.get("optimizer.type")
    if isinstance(kind, str) and kind:
        cls = catalog.optimizer_class(kind)
        if cls is not None:
            reading.values["optimizer.type"] = cls.__name__
    kind = reading.values.get("scheduler.type")
    if isinstance(kind, str) and kind:
        reading.values["scheduler.type"] = catalog.schedule_name(kind) or kind


def _auto_stage_opens_offload(reading: Reading) -> None:
    """`stage: auto` lets the planner offload too, unless the file says where each state lives; a planned
    optimizer offload (stage or device auto) also plans how much of the state stays on the GPU, unless
    the file writes `offload_optimizer.ratio`."""
    if is_auto(reading.values.get("zero.stage")):
        for kind in ("offload_optimizer", "offload_param"):
            reading.values.setdefault(f"zero.{kind}.device", AUTO)
    if is_auto(reading.values.get("zero.stage")) or is_auto(reading.values.get("zero.offload_optimizer.device")):
        reading.values.setdefault("zero.offload_optimizer.ratio", AUTO)


def save_config(config: RunConfig, path: str | os.PathLike[str]) -> None:
    """Write `config` in zerofit's format (JSON for a `.json` path, YAML otherwise); `load_config` reads it back."""
    zerofit_yaml.dump(config, path)
