"""What a model's checkpoint holds: its parameters (in the engine's order), tied aliases, buffers.

Parameters are named by their first occurrence in the module tree (what `named_parameters()` says);
a tied weight (an embedding shared with the head) is one parameter, stored once, and its other
state-dict keys are listed as aliases. Persistent buffers (BatchNorm statistics, ...) are replicated
on every rank: rank 0 saves them and every rank loads them whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from zerofit.errors import CheckpointError


@dataclass(frozen=True)
class Entry:
    """One tensor of the model's state dict, as the checkpoint describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """The dtype a consolidated export writes: fp32 for trainable parameters (the master), the
    compute dtype for frozen ones, the buffer's own dtype for buffers."""
    kind: str
    """'master' (trainable parameter), 'param' (frozen parameter) or 'buffer'."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=dtype_of(self.dtype)).element_size()

    def to_json(self) -> dict:
        return asdict(self) | {"shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> Entry:
        try:
            entry = cls(name=str(data["name"]), shape=tuple(int(s) for s in data["shape"]),
                        dtype=str(data["dtype"]), kind=str(data["kind"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed tensor entry {data!r} ({e})") from None
        dtype_of(entry.dtype, source)
        return entry


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, source: str = "checkpoint") -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{source}: unknown dtype {name!r}")
    return dtype


def param_entries(engine, *, saved: bool = False) -> list[Entry]:
    """Every parameter the engine manages, unit by unit, in flat-buffer order, in the dtype the sharded
    checkpoint stores (fp32 masters, frozen ones in the compute dtype) or, with `saved`, the dtype the
    weights are saved in: each parameter's own when prepared ([Note: saved dtype] in
    zerofit.checkpoint.consolidate)."""
    out = []
    for g in engine.groups:
        stored = torch.float32 if g.trainable else g.compute_dtype
        for name, shape, arrived in zip(g.names, g.shapes, g.arrived):
            out.append(Entry(name=name, shape=tuple(shape), dtype=dtype_name(arrived if saved else stored),
                             kind="master" if g.trainable else "param"))
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) for the buffers that belong in the state dict, each shared buffer once."""
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


def buffer_entries(model: nn.Module) -> list[Entry]:
    return [Entry(name=n, shape=tuple(b.shape), dtype=dtype_name(b.dtype), kind="buffer")
            for n, b in persistent_buffers(model)]


def aliases(model: nn.Module) -> dict[str, str]:
    """Other names of tied parameters -> the name they are stored under."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
