"""One entry point for every config file: detect the format, read it, apply command-line overrides, validate.

`load_config` tells the three formats apart by their content, not the file name, because people name
Accelerate configs `.json` and DeepSpeed configs `.yaml` alike: `distributed_type` or
`compute_environment` mean Accelerate; zerofit's section names (`launch`, `zero`, `precision`, ...)
mean zerofit; DeepSpeed's own keys (`zero_optimization`, `train_batch_size`, `fp16`, ...) mean
DeepSpeed. Command-line values, given as dotted zerofit keys, win over the file. Every problem (key
spelling, value type, cross-field rule) comes back in one ConfigError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
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


def detect_format(data: Mapping[str, Any], *, suffix: str = "") -> str:
    """ "accelerate", "zerofit" or "deepspeed", from the keys of a parsed file; ConfigError if none fits.

    A file with only keys both DeepSpeed and zerofit know (`optimizer`, `checkpoint`, ...) is read
    the way that gives fewer problems; on a tie, as zerofit's unless it is a `.json` file.
    """
    keys = set(map(str, data))
    if keys & set(_ACCELERATE_MARKERS):
        return "accelerate"
    if keys & set(_ZEROFIT_MARKERS):
        return "zerofit"
    if keys & (deepspeed_json.TOP_LEVEL - _SHARED):
        return "deepspeed"
    if keys <= _SHARED:
        order = ("deepspeed", "zerofit") if suffix == ".json" else ("zerofit", "deepspeed")
        readers = {"deepspeed": deepspeed_json.read, "zerofit": zerofit_yaml.read}
        return min(order, key=lambda kind: len(readers[kind](data).problems))
    raise ConfigError(
        [
            f"cannot tell the config format from its keys ({', '.join(sorted(keys))}): an Accelerate config has "
            "distributed_type, a DeepSpeed config zero_optimization or train_batch_size, a zerofit config "
            "launch / zero / precision / batch sections"
        ]
    )


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
    kind = detect_format(data, suffix=suffix) if data else "zerofit"
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
    reading.emit_warnings()
    if settle is not None and not reading.problems:
        _apply_overrides(reading, settle(tree.build_config(reading.values)))
    config = tree.build_config(reading.values)
    problems = reading.problems + list(
        validate.messages(validate.find_problems(config), skip_keys=reading.invalid)
    )
    if problems:
        raise ConfigError(problems, reading.source)
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
