"""Nested Python values stored without pickle: a JSON file, plus a safetensors file for the tensors.

`extra_state` (scheduler state, step counters, RNG states, data position, custom objects' state),
optimizer hyperparameters and scalar state all go through here. JSON cannot express every value the
training loop has, so a few shapes are tagged with the key `"__zerofit__"`:

| value                            | stored as                                            |
|----------------------------------|------------------------------------------------------|
| str, int, float, bool, None      | itself (floats round-trip exactly; inf/nan allowed)  |
| list                             | a list                                               |
| dict with str keys               | an object                                            |
| dict with other keys (int, ...)  | `{"__zerofit__": "dict", "items": [[k, v], ...]}`    |
| tuple                            | `{"__zerofit__": "tuple", "items": [...]}`           |
| torch.Tensor                     | `{"__zerofit__": "tensor", "key": "t3"}`, data in the safetensors file |
| numpy array / numpy scalar       | `{"__zerofit__": "ndarray", ...}` / its Python value |
| torch.dtype                      | `{"__zerofit__": "dtype", "name": "float32"}`        |

Anything else is refused at save time with the key path and a fix, never pickled. Reading executes
nothing: `json.loads` and `safetensors` only. Every JSON file of a checkpoint (these, the manifest) is
read by `read_json`, the config files' bounded reader (`zerofit.config.files`) with MAX_JSON_BYTES: a
file nested too deeply, not UTF-8 or too large is a CheckpointError naming it, never a traceback on one
rank while its peers wait (see [Note: agreeing on failure] in `ranks`). A save refuses to write a JSON
file larger than a load reads back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from zerofit.config import files
from zerofit.errors import CheckpointError

TAG = "__zerofit__"
FORMAT = "zerofit-tree/1"
MAX_JSON_BYTES = 64 << 20
"""64 MiB: a checkpoint's JSON holds counters, RNG states and small state dicts (tensors and arrays go
to safetensors); far beyond that is a damaged or foreign file, not worth parsing into memory on every rank."""
_DAMAGED = "the checkpoint is damaged or was edited; load an earlier checkpoint"


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional; without it no value can be a numpy array either
        return None
    return numpy


def encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """`value` as JSON-ready data; tensors are moved (copied to CPU) into `tensors`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {TAG: "tensor", "key": key}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "name": str(value).removeprefix("torch.")}
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {TAG: "ndarray", "key": key}
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {TAG: "dict", "items": [[encode(k, tensors, f"{where} key {k!r}"),
                                        encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot "
        "store without pickle: pass JSON-able values (dict, list, tuple, str, int, float, bool, None), "
        "tensors or numpy arrays instead, e.g. the object's state_dict()")


def decode(data: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    """The inverse of `encode`; `source` names the file in error messages."""
    if isinstance(data, list):
        return [decode(v, tensors, source) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(TAG)
    if kind is None:
        return {k: decode(v, tensors, source) for k, v in data.items()}
    if kind in ("tensor", "ndarray"):
        key = data.get("key")
        if key not in tensors:
            raise CheckpointError(f"{source}: refers to tensor {key!r}, which its safetensors file lacks: "
                                  "the checkpoint is damaged; load an earlier one")
        return tensors[key] if kind == "tensor" else tensors[key].numpy()
    if kind == "tuple":
        return tuple(decode(v, tensors, source) for v in data["items"])
    if kind == "dict":
        return {_hashable(decode(k, tensors, source)): decode(v, tensors, source) for k, v in data["items"]}
    if kind == "dtype":
        dtype = getattr(torch, str(data.get("name")), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{source}: unknown dtype {data.get('name')!r}")
        return dtype
    raise CheckpointError(f"{source}: unknown tagged value {kind!r} (written by a newer zerofit?): "
                          "upgrade zerofit")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to the device before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_tree(directory: Path, stem: str, value: Any, where: str) -> list[str]:
    """Store `value` as `<stem>.json` (+ `<stem>.safetensors` when it holds tensors); returns the names."""
    tensors: dict[str, torch.Tensor] = {}
    data = encode(value, tensors, where)
    return write_encoded(directory, stem, data, tensors)


def write_encoded(directory: Path, stem: str, data: Any, tensors: dict[str, torch.Tensor]) -> list[str]:
    """`write_tree` for a value already passed through `encode` (so errors surface before any write)."""
    names = [f"{stem}.json"]
    if tensors:
        names.append(f"{stem}.safetensors")
        save_file(tensors, str(directory / names[1]), metadata={"format": "pt"})
        with open(directory / names[1], "rb+") as f:
            os.fsync(f.fileno())
    text = json.dumps({"format": FORMAT, "value": data}, indent=1, sort_keys=False).encode()
    if len(text) > MAX_JSON_BYTES:
        raise CheckpointError(f"{directory / names[0]}: would hold {len(text) >> 20} MiB of JSON, more than the "
                              f"{MAX_JSON_BYTES >> 20} MiB a load reads back: keep large values in tensors or numpy "
                              "arrays (stored in safetensors), not in lists")
    write_durable(directory / names[0], text)
    return names


def read_json(path: Path) -> Any:
    """The JSON document at `path`, read within bounds (FileNotFoundError when there is none); any other
    problem is a CheckpointError naming the file."""
    try:
        return files.load(path, as_json=True, max_bytes=MAX_JSON_BYTES, what="zerofit checkpoint file",
                          max_values=None)
    except files.BadFile as bad:
        raise CheckpointError(f"{bad.problem}: {_DAMAGED}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): {_DAMAGED}") from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e}): check the file's permissions, or "
                              "load another checkpoint") from None


def read_tree(directory: Path, stem: str) -> Any:
    """The value `write_tree` stored under `stem` in `directory`."""
    path = directory / f"{stem}.json"
    try:
        doc = read_json(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete; load an earlier one") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise CheckpointError(f"{path}: not a {FORMAT} file (format {found!r})")
    tensors: dict[str, torch.Tensor] = {}
    side = directory / f"{stem}.safetensors"
    if side.exists():
        try:
            tensors = load_file(str(side))
        except Exception as e:  # noqa: BLE001 - safetensors raises several kinds on a damaged file
            raise CheckpointError(f"{side}: unreadable safetensors file ({e}): the file is corrupt; load "
                                  "an earlier checkpoint") from None
    try:
        return decode(doc["value"], tensors, str(path))
    except RecursionError:  # parsed, but too deep to rebuild (decode recurses once per level)
        raise CheckpointError(f"{path}: nested too deeply to be a zerofit checkpoint file: {_DAMAGED}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a tagged value of the wrong shape
        raise CheckpointError(f"{path}: malformed ({type(e).__name__}: {e}): {_DAMAGED}") from None
