"""How each config format spells each zerofit key, so every message uses the user's own names.

A DeepSpeed user reads `zero_optimization.offload_param`, an Accelerate user
`deepspeed_config.offload_param_device`, a zerofit user `zero.offload_param`; all three are the same
key. The format is carried on the config (`RunConfig.source_format`), so messages raised after
`auto` resolution, on workers, still speak the language of the file the user wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from . import accelerate_yaml, deepspeed_json


def _inverse(table: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    names: dict[str, str] = {}
    for user_key, key in table.items():
        names.setdefault(key, user_key)
    names.update(extra)
    return names


@functools.cache
def _chains() -> dict[str, tuple[dict[str, str], ...]]:
    deepspeed = _inverse(deepspeed_json.TABLE, deepspeed_json.SECTION_NAMES)
    accelerate = _inverse(accelerate_yaml.TABLE, accelerate_yaml.SECTION_NAMES)
    launch_only = {
        k: v for k, v in accelerate.items() if k.startswith(("launch.", "precision.", "compile."))
    }
    return {
        "zerofit": (),
        "deepspeed": (deepspeed,),
        "accelerate": (accelerate,),
        # With deepspeed_config_file, the JSON holds everything but the launch keys, the YAML's precision and dynamo.
        "accelerate+deepspeed": (deepspeed, launch_only),
    }


def key_name(source_format: str, key: str) -> str:
    """The user's spelling of zerofit `key`; the zerofit key itself where the format has none."""
    for names in _chains().get(source_format, ()):
        if key in names:
            return names[key]
    return key


def turn_off(source_format: str, offload_key: str) -> str:
    """The fix that disables an offload section, in the user's terms."""
    section = key_name(source_format, offload_key)
    if section == key_name(source_format, f"{offload_key}.device"):
        return f"set {section} to none"
    return f"remove {section}"
