"""Refusing a key written twice in one mapping of a JSON or YAML file.

Python's `json` and PyYAML keep the last of two equal keys without a word, so a DeepSpeed JSON with
`zero_optimization` twice (stage 3, then stage 1) would run stage 1, and `{"stage": 2, "stage":
"auto"}` would run the planner. DeepSpeed refuses such JSON; zerofit refuses it in every format it
reads, at any depth, naming the dotted key and both line numbers (`Duplicate`).

JSON: `json.loads` with an `object_pairs_hook` that only notices a repeat (cheap, C-speed parsing
stays); only then does `_json_duplicate` scan the text once more to find the key's path and lines.
YAML: `UniqueKeyLoader` checks the composed node tree before anything is constructed, where every key
still carries its line. The check runs before construction because merge keys (`<<: *base`) may
legitimately repeat a key of the merged mapping, and PyYAML flattens merges into the nodes while it
constructs. Configs given as Python dicts cannot hold duplicates and never come here.
"""

from __future__ import annotations

import json
from json.decoder import scanstring
from typing import Any

import yaml


class Duplicate(Exception):
    """`key` (dotted, from the top of the file) appears at `first` and again at `second` (1-based lines)."""

    def __init__(self, key: str, first: int, second: int):
        super().__init__(f"{key} appears twice (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


def load_json(text: str) -> Any:
    """`json.loads(text)`, raising Duplicate when an object holds a key twice."""
    repeated = False

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeated
        out = dict(pairs)
        repeated = repeated or len(out) != len(pairs)
        return out

    data = json.loads(text, object_pairs_hook=pairs_to_dict)
    if repeated:
        found = _json_duplicate(text)
        if found is not None:
            raise found
    return data


def _json_duplicate(text: str) -> Duplicate | None:
    """The first repeated key of the valid JSON `text`, with its path and lines (a second, slow pass
    that runs only for a file known to repeat a key). Strings hold no raw newline in valid JSON, so
    counting newlines outside them gives the line."""
    # One frame per open container: [path, {key: line} or None for an array, pending key or index]
    stack: list[list[Any]] = []
    line, i, n = 1, 0, len(text)
    expect_key = False
    while i < n:
        c = text[i]
        if c == '"':
            value, end = scanstring(text, i + 1)
            if expect_key:
                path, seen, _ = stack[-1]
                if value in seen:
                    return Duplicate(f"{path}{value}", seen[value], line)
                seen[value] = line
                stack[-1][2] = value
            i = end
            continue
        if c == "\n":
            line += 1
        elif c in "{[":
            path = _child_path(stack)
            stack.append([f"{path}." if path and c == "{" else path, {} if c == "{" else None, 0])
            expect_key = c == "{"
        elif c in "}]":
            stack.pop()
            expect_key = False
        elif c == ",":
            frame = stack[-1]
            expect_key = frame[1] is not None
            if frame[1] is None:
                frame[2] += 1
        elif c == ":":
            expect_key = False
        i += 1
    return None


def _child_path(stack: list[list[Any]]) -> str:
    """The dotted path of a container opening at the current position of `_json_duplicate`'s scan."""
    if not stack:
        return ""
    path, seen, pending = stack[-1]
    if seen is None:  # inside an array: `name[3]`
        return f"{path}[{pending}]"
    return f"{path}{pending}"


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises Duplicate for a key written twice in one mapping (merge keys aside)."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node)
        return super().construct_document(node)

    def _check_unique(self, root: yaml.Node) -> None:
        """Walk every mapping once, in document order (aliases point at nodes already seen)."""
        stack: list[tuple[yaml.Node, str]] = [(root, "")]
        visited: set[int] = set()
        while stack:
            node, path = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            children: list[tuple[yaml.Node, str]] = []
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, value_node in node.value:
                    name = self._key_of(key_node)
                    children.append((value_node, f"{path}{name}." if name is not None else path))
                    if name is None:
                        continue
                    line = key_node.start_mark.line + 1
                    if name in seen:
                        raise Duplicate(f"{path}{name}", seen[name], line)
                    seen[name] = line
            elif isinstance(node, yaml.SequenceNode):
                children = [(item, f"{path.rstrip('.')}[{i}].") for i, item in enumerate(node.value)]
            stack.extend(reversed(children))

    def _key_of(self, key_node: yaml.Node) -> Any:
        """The key as the mapping will hold it (`1` and `1.0` are one key), or None for a merge key
        (`<<`, allowed to repeat what it merges) and keys that are not plain values."""
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            return None
        try:
            key = self.construct_object(key_node)
            hash(key)
        except (yaml.YAMLError, TypeError, ValueError):
            return None  # construction reports it with its own message
        return key


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, raising Duplicate when a mapping holds a key twice."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
