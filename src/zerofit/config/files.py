"""Reading a small structured file: a regular file of bounded size, UTF-8, parsed as JSON or YAML.

Config files are small (a DeepSpeed JSON or an Accelerate YAML is a few kilobytes), so anything over
MAX_BYTES is refused before it is parsed, and so is anything that is not a regular file - a FIFO or
`/dev/zero` given as `deepspeed_config_file` would otherwise be read forever. A key written twice in one
mapping is refused too (`duplicates`): the parsers would keep the last one silently. A checkpoint's JSON files
(`zerofit.checkpoint.tree.read_json`) are read by the same rules with a larger bound. Each failure is
one `BadFile` naming the path, the problem and (for configs) the fix; the callers turn it into their
own error.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from .duplicates import Duplicate, load_json, load_yaml

MAX_BYTES = 1 << 20
"""1 MiB: far beyond any real config, small enough to parse at once."""

MAX_VALUES = 100_000
"""Values a config may hold once YAML aliases are expanded (a few nested `*name`s can make billions)."""


class BadFile(Exception):
    """A file that cannot be read as one of its kind: `problem` names the path and what is wrong, `fix`
    what to do about a config file; the message is both (callers with their own fix use `problem`)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}: {fix}")
        self.problem = problem


def read_text(path: Path, *, max_bytes: int = MAX_BYTES, what: str = "config") -> str:
    """The UTF-8 text of the regular file at `path` (FileNotFoundError when there is none); `what` the
    file should be, as messages say it."""
    if str(path) in ("", "."):
        raise BadFile("path is empty", f"pass the {what} file's path")
    if "\0" in str(path):
        raise BadFile(f"path {str(path)[:200]!r} holds a NUL byte", f"pass the {what} file's path")
    info = path.stat()  # FileNotFoundError for the caller's own message
    if stat.S_ISDIR(info.st_mode):
        raise BadFile(f"{str(path)!r} is a directory", f"pass the {what} file inside it")
    if not stat.S_ISREG(info.st_mode):
        raise BadFile(f"{str(path)!r} is not a regular file (a pipe or device)", f"pass a {what} file")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise BadFile(f"{str(path)!r} is larger than {max_bytes // 1024} KiB, which no {what} is", "check the path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"{str(path)!r} is not UTF-8 text (byte {e.start})", "save it as UTF-8") from None


def load(path: Path, *, as_json: bool, max_bytes: int = MAX_BYTES, what: str = "config",
         max_values: int | None = MAX_VALUES) -> Any:
    """The file at `path` parsed as JSON or YAML (safe loading), read by `read_text`; a key written twice in
    one mapping, nesting too deep to parse, or (with `max_values`) more values than that once aliases are
    expanded, is a BadFile."""
    text = read_text(path, max_bytes=max_bytes, what=what)
    try:
        data = load_json(text) if as_json else load_yaml(text)
    except Duplicate as twice:
        raise BadFile(f"{str(path)!r}: {twice}", f"keep one {twice.key} and delete the other (a JSON or YAML "
                      "reader silently keeps the last one, so the file does not say which is meant)") from None
    except RecursionError:
        raise BadFile(f"{str(path)!r} is nested too deeply to be a {what}", "check the file") from None
    except ValueError as e:  # not a syntax error: a number with more digits than Python converts (4300)
        if isinstance(e, json.JSONDecodeError) or "digits" not in str(e):
            raise
        raise BadFile(f"{str(path)!r} holds a number with thousands of digits, which no {what} holds",
                      "check the file") from None
    if max_values is not None and _expanded_size(data, max_values + 1) > max_values:
        raise BadFile(f"{str(path)!r} expands to more than {max_values} values (YAML aliases repeating each "
                      f"other), which no {what} holds", "write the values out")
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
