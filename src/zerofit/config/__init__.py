"""zerofit's config: one typed tree, read from zerofit YAML, Accelerate launch YAML or DeepSpeed JSON.

`load_config` reads a file (any of the three formats) and validates it; `resolve_auto` fills "auto"
values from the running script's `ScriptFacts`; `validate_config` checks the cross-field rules;
`save_config` writes the zerofit form that the launcher hands to every worker.
"""

from __future__ import annotations

from .auto import ScriptFacts, resolve_auto
from .load import config_from_dict, detect_format, load_config, save_config
from .reading import ConfigWarning
from .schema import AUTO, RunConfig, is_auto, to_dict
from .validate import validate_config

__all__ = [
    "AUTO",
    "ConfigWarning",
    "RunConfig",
    "ScriptFacts",
    "config_from_dict",
    "detect_format",
    "is_auto",
    "load_config",
    "resolve_auto",
    "save_config",
    "to_dict",
    "validate_config",
]
