"""Hugging Face weight files: the shard plan, the file names and index, and a writer fed tensor by tensor.

The files are what `from_pretrained` reads: `model.safetensors`, or above `max_shard_size`
`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` (`{"metadata": {"total_size"},
"weight_map": {name: file}}`); `pytorch_model*.bin` likewise with `safe_serialization=False`.
Shards are planned up front from the tensors' sizes alone, so the online export (tensors gathered
unit by unit) and the offline merge (tensors read from a checkpoint) write identical files, and each
shard is written and dropped as soon as its last tensor arrives.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerofit.checkpoint.inventory import Entry
from zerofit.errors import CheckpointError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "5GB" (10**9) or "500MiB" (2**20), as HF reads them."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not match or float(match.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size={size!r} is not a size: pass bytes as an int or a string "
                              "like '5GB', '500MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of `entries` of at most `max_bytes` each (a bigger tensor gets a shard alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def file_names(count: int, safe: bool) -> tuple[list[str], str]:
    """The weight file names for `count` shards, and the index file name."""
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    if count == 1:
        return [f"{stem}.{ext}"], f"{stem}.{ext}.index.json"
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)], f"{stem}.{ext}.index.json"


class ShardWriter:
    """Writes the planned shards into `directory` as their tensors arrive (one process)."""

    def __init__(self, directory: Path, plan: list[list[Entry]], *, safe: bool = True):
        self.directory = directory
        self.plan = plan
        self.safe = safe
        self.names, self.index_name = file_names(len(plan), safe)
        self.shard_of = {e.name: i for i, shard in enumerate(plan) for e in shard}
        self.pending: list[dict[str, torch.Tensor]] = [{} for _ in plan]
        self.written = [False] * len(plan)
        directory.mkdir(parents=True, exist_ok=True)
        for p in directory.iterdir():  # weight files of an earlier export would mix with these
            if p.is_file() and _WEIGHT_FILE.match(p.name):
                p.unlink()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        i = self.shard_of.get(name)
        if i is None:
            raise CheckpointError(f"{name}: not in the planned export (an internal error: please report it)")
        self.pending[i][name] = tensor
        if len(self.pending[i]) == len(self.plan[i]):
            self._write(i)

    def _write(self, i: int) -> None:
        tensors, self.pending[i] = self.pending[i], {}
        path = self.directory / self.names[i]
        tmp = path.with_name(f".{path.name}.tmp")
        if self.safe:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, path)
        self.written[i] = True

    def finish(self) -> list[str]:
        """Write the index (for several shards); returns the files written."""
        for i, shard in enumerate(self.plan):
            if not self.written[i] and len(self.pending[i]) == len(shard):  # an empty plan: one empty file
                self._write(i)
        missing = [e.name for i, shard in enumerate(self.plan) if not self.written[i] for e in shard
                   if e.name not in self.pending[i]]
        if missing:
            raise CheckpointError(f"export to {self.directory}: no values arrived for {missing[:5]} "
                                  "(an internal error: please report it)")
        if len(self.plan) == 1:
            return list(self.names)
        weight_map = {e.name: self.names[i] for i, shard in enumerate(self.plan) for e in shard}
        index = {"metadata": {"total_size": sum(e.nbytes for shard in self.plan for e in shard)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / self.index_name).write_text(json.dumps(index, indent=2) + "\n")
        return [*self.names, self.index_name]


def save_hf_configs(model, directory: Path) -> None:
    """`config.json` (and `generation_config.json`) of a Hugging Face model; nothing for other models."""
    for attr in ("config", "generation_config"):
        cfg = getattr(model, attr, None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg.save_pretrained(str(directory))
