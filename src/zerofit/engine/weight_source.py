"""Pretrained weights for a model built on the meta device, read one unit at a time.

    zerofit.utils.load_at_prepare(model, "path/to/checkpoint")   # marks the model (`mark`)
    model, opt = accelerator.prepare(model, opt)                 # the engine finds the mark (`source_for`)

A model too large for one host copy per rank is built empty, and the engine's `Materializer` asks this
module for the values of each unit's tensors as it makes them real: only that unit's tensors are read,
from memory-mapped safetensors files (ranks on one machine share the page cache), converted to the
tensor's dtype and copied to the device. Tensors the checkpoint lacks (a new classification head) are
initialised as an unmarked meta model's are, and named in one warning; checkpoint tensors the model
lacks are named in one notice.

[Note: checkpoint names]
A model tensor reads the checkpoint key of one of its names (a tied weight has several: GPT-2's
`lm_head.weight` is `transformer.wte.weight`), exact names first. Failing those, the name with the
model's `base_model_prefix` (Hugging Face's attribute; "model" for Llama) taken off or put on, so a
base-model checkpoint fills a `*ForCausalLM` and the other way round. Non-persistent buffers (rotary
frequencies) are not in checkpoints: their module's own initialisation computes them.

The mark lives in a weak dictionary keyed by the module, so a model that is dropped takes its mark with
it and nothing is set on the model itself.
"""

from __future__ import annotations

import json
import warnings
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zerofit.errors import CheckpointError, EngineError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_marks: weakref.WeakKeyDictionary[nn.Module, CheckpointFiles] = weakref.WeakKeyDictionary()
"""Model (or submodule) -> the checkpoint `prepare()` fills it from."""


class CheckpointFiles:
    """The safetensors files of a checkpoint directory and the file of each tensor (index or headers only)."""

    def __init__(self, directory: str | Path, *, caller: str = "load_at_prepare"):
        """`caller`: the public function the errors name."""
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{caller}: checkpoint directory {str(self.directory)!r} does not exist "
                                  "(or is not a directory): pass the directory save_pretrained wrote, the one "
                                  f"holding config.json and {SINGLE_FILE} or {INDEX_FILE}")
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            self.file_of = self._read_index(index, caller)
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), single)
        else:
            others = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".safetensors", ".pt"))
            found = f"it holds {others[:5]}" if others else "it holds no weight files"
            raise CheckpointError(f"{caller}: no safetensors weights in {str(self.directory)!r}: looked for "
                                  f"{INDEX_FILE} (sharded) and {SINGLE_FILE}, and {found}. Save the checkpoint with "
                                  "save_pretrained(directory) (safetensors is its default), or pass the directory "
                                  "that holds those files")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.file_of.values())):
            with safe_open(str(file), framework="pt") as f:
                self.shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
        self._open: dict[Path, object] = {}

    def _read_index(self, index: Path, caller: str) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{caller}: {index} is not a safetensors index ({e}): it must be JSON with "
                                  "a 'weight_map' of tensor name -> file; save the checkpoint again with "
                                  "save_pretrained") from e
        file_of = {key: self.directory / name for key, name in weight_map.items()}
        absent = sorted({p.name for p in file_of.values() if not p.is_file()})
        if absent:
            raise CheckpointError(f"{caller}: {index} names files that are not in {str(self.directory)!r}: "
                                  f"{absent[:5]}; copy the whole checkpoint directory")
        return file_of

    def read(self, key: str) -> torch.Tensor:
        """The tensor `key` as stored (a CPU tensor; its file stays open until `close`)."""
        file = self.file_of[key]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_tensor(key)

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap their file when dropped


def mark(model: nn.Module, files: CheckpointFiles) -> None:
    """Have `prepare()` fill the meta tensors of `model` from `files` (see `zerofit.utils.load_at_prepare`)."""
    _marks[model] = files


def _marked(model: nn.Module) -> tuple[nn.Module, CheckpointFiles] | None:
    """The outermost marked module of `model` (itself, or the model a wrapper holds) and its checkpoint."""
    for module in model.modules():
        files = _marks.get(module)
        if files is not None:
            return module, files
    return None


def source_for(model: nn.Module, *, has_meta: bool) -> WeightSource | None:
    """The weight source of a marked `model` (None when unmarked); the checkpoint's names are checked here,
    before any unit is made real."""
    found = _marked(model)
    if found is None:
        return None
    module, files = found
    if not has_meta:
        raise EngineError(f"{type(module).__name__} was marked by load_at_prepare({str(files.directory)!r}) but "
                          "has no meta tensors left, so there is nothing to fill: build it on the meta device "
                          "and do not materialise it before prepare(), or load it with from_pretrained instead")
    return WeightSource(module, files)


class WeightSource:
    """Which checkpoint key fills each meta tensor of one model, and the copy itself (see [Note: checkpoint
    names]). Tensors are known by the id of their meta original, which the Materializer replaces."""

    def __init__(self, module: nn.Module, files: CheckpointFiles):
        self.files = files
        prefix = getattr(module, "base_model_prefix", "") or ""
        # keep_vars: the state dict's values are the tensors themselves, under every name (tied ones too);
        # it lists parameters and persistent buffers, which are what a checkpoint holds. Tensors already
        # real (a model built partly on a device) keep their values.
        names_of: dict[int, list[str]] = {}
        shape_of: dict[int, tuple[int, ...]] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            if not t.is_meta:
                continue
            names_of.setdefault(id(t), []).append(name)
            shape_of[id(t)] = tuple(t.shape)
        self.key_of: dict[int, str] = {}
        """id(meta tensor) -> its checkpoint key."""
        self.missing: list[str] = []
        """Names of the meta tensors the checkpoint lacks (initialised instead)."""
        for tid, names in names_of.items():
            key = _find_key(names, prefix, files.shapes)
            if key is None:
                self.missing.append(names[0])
                continue
            if files.shapes[key] != shape_of[tid]:
                raise EngineError(
                    f"checkpoint tensor {key!r} in {files.file_of[key]} has shape {list(files.shapes[key])} but the "
                    f"model's {names[0]!r} has shape {list(shape_of[tid])}: build the model from the checkpoint's "
                    f"own config (AutoConfig.from_pretrained({str(files.directory)!r})) or pass load_at_prepare the "
                    "checkpoint of this model")
            self.key_of[tid] = key
        if names_of and not self.key_of:
            example = next(iter(names_of.values()))[0]
            raise EngineError(f"none of the {len(names_of)} meta tensors of {type(module).__name__} is in the "
                              f"checkpoint {str(files.directory)!r} (e.g. {example!r}; the checkpoint has "
                              f"{sorted(files.shapes)[:3]}): pass load_at_prepare the checkpoint of this model")
        used = {c for tid in self.key_of for name in names_of[tid] for c in _candidates(name, prefix)}
        quiet = {k for name, _ in module.named_buffers() for k in _candidates(name, prefix)}  # non-persistent
        self.unexpected = sorted(k for k in files.shapes if k not in used and k not in quiet)
        """Checkpoint keys no model tensor reads."""

    def has(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.key_of

    def fill(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        """Copy the checkpoint's value of `meta` into `real` (its replacement on the device), in `real`'s dtype."""
        real.copy_(self.files.read(self.key_of[id(meta)]))

    def finish(self, *, announce: bool) -> None:
        """Close the files; with `announce`, warn once of what was initialised and what went unread."""
        self.files.close()
        if not announce:
            return
        where = str(self.files.directory)
        if self.missing:
            warnings.warn(f"zerofit: {len(self.missing)} tensor(s) of the model are not in the checkpoint {where!r} "
                          f"and were newly initialised: {_listed(self.missing)}. You should probably train the model "
                          "before using it (a new head is expected when fine-tuning a base checkpoint)", stacklevel=2)
        if self.unexpected:
            warnings.warn(f"zerofit: {len(self.unexpected)} tensor(s) of the checkpoint {where!r} are not in the model "
                          f"and were not read: {_listed(self.unexpected)} (expected when loading a checkpoint with a "
                          "head into a model without it)", stacklevel=2)


def _candidates(name: str, prefix: str) -> list[str]:
    """`name`, then `name` with the base model's prefix taken off or put on."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


def _find_key(names: list[str], prefix: str, keys: dict[str, tuple[int, ...]]) -> str | None:
    for name in names:  # every exact name before any prefixed one
        if name in keys:
            return name
    for name in names:
        for candidate in _candidates(name, prefix)[1:]:
            if candidate in keys:
                return candidate
    return None


def _listed(names: list[str], most: int = 20) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names) - most} more)"
