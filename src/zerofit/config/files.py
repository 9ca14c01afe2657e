"""Reading a config file's text: a regular file of bounded size, UTF-8, parsed as JSON or YAML.

Config files are small (a DeepSpeed JSON or an Accelerate YAML is a few kilobytes), so anything over
MAX_BYTES is refused before it is parsed, and so is anything that is not a regular file - a FIFO or
`/dev/zero` given as `deepspeed_config_file` would otherwise be read forever. Each failure is one
`BadFile` whose message names the path and the fix; the callers turn it into their own error.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20
"""1 MiB: far beyond any real config, small enough to parse at once."""

MAX_VALUES = 100_000
"""Values a config may hold once YAML aliases are expanded (a few nested `*name`s can make billions)."""


class BadFile(Exception):
    """A config file that cannot be read as one (the message says why and what to do)."""


def read_text(path: Path) -> str:
    """The UTF-8 text of the regular file at `path` (FileNotFoundError when there is none)."""
    if str(path) in ("", "."):
        raise BadFile("path is empty: pass the config file's path")
    if "\0" in str(path):
        raise BadFile(f"path {str(path)[:200]!r} holds a NUL byte: pass the config file's path")
    info = path.stat()  # FileNotFoundError for the caller's own message
    if stat.S_ISDIR(info.st_mode):
        raise BadFile(f"{str(path)!r} is a directory: pass the config file inside it")
    if not stat.S_ISREG(info.st_mode):
        raise BadFile(f"{str(path)!r} is not a regular file (a pipe or device): pass a config file")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise BadFile(f"{str(path)!r} is larger than {MAX_BYTES // 1024} KiB, which no config is: check the path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"{str(path)!r} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None


def load(path: Path, *, as_json: bool) -> Any:
    """The file at `path` parsed as JSON or YAML (yaml.safe_load); nesting too deep to parse is a BadFile."""
    text = read_text(path)
    try:
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except RecursionError:
        raise BadFile(f"{str(path)!r} is nested too deeply to be a config: check the file") from None
    except ValueError as e:  # not a syntax error: a number with more digits than Python converts (4300)
        if isinstance(e, json.JSONDecodeError) or "digits" not in str(e):
            raise
        raise BadFile(f"{str(path)!r} holds a number with thousands of digits, which no setting has: check the "
                      "file") from None
    if _expanded_size(data, MAX_VALUES + 1) > MAX_VALUES:
        raise BadFile(f"{str(path)!r} expands to more than {MAX_VALUES} values (YAML aliases repeating each "
                      "other), which no config holds: write the values out")
    return data


def _expanded_size(data: Any, budget: int) -> int:
    """How many values `data` holds with shared (aliased) parts counted each time, counting up to `budget`."""
    count, stack = 0, [data]
    while stack and count < budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
            stack.extend(item.keys())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count
