"""Collectives on nested data for scripts: gather, reduce, pad across processes, move to a device.

Every function takes a tensor or any nesting of lists, tuples and mappings of tensors (a model's
output dict, a `BatchEncoding`) and returns the same structure. With one process (no process group)
each one returns its input, so scripts need no special case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerofit.distributed.collectives import Peers
from zerofit.distributed.failures import named


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def recurse(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """`data` with `fn` applied to every tensor inside it, containers rebuilt with their own type."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(recurse(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recurse(fn, v) for v in data)
    if isinstance(data, Mapping):
        items = {k: recurse(fn, v) for k, v in data.items()}
        try:
            return type(data)(items)
        except TypeError:  # a mapping type that cannot be rebuilt from a dict
            return items
    return data


def send_to_device(data: Any, device: torch.device, *, non_blocking: bool = True) -> Any:
    """`data` with every tensor on `device` (objects with their own `.to`, such as BatchEncoding, use it)."""
    if not isinstance(data, (torch.Tensor, list, tuple, Mapping)) and hasattr(data, "to"):
        return data.to(device)
    if isinstance(data, Mapping) and hasattr(data, "to") and not isinstance(data, dict):
        return data.to(device)
    return recurse(lambda t: t.to(device, non_blocking=non_blocking and device.type == "cuda"), data)


def wire_device(t: torch.Tensor, backend: str) -> torch.device:
    """Where `t` must be for `backend`'s collectives: NCCL moves only CUDA tensors, so a CPU tensor (a
    metric, a count) travels through this process's GPU and comes back; gloo takes it where it is."""
    if backend == "nccl" and t.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _wire(t: torch.Tensor) -> torch.device:
    return wire_device(t, dist.get_backend() if dist.is_initialized() else "gloo")


def _gather_one(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 0:
        t = t[None]
    wire = _wire(t)
    sent = t.to(wire).contiguous()
    parts = [torch.empty_like(sent) for _ in range(_world())]
    with named("gather", _rank()):
        dist.all_gather(parts, sent)
    return torch.cat(parts, dim=0).to(t.device)


def gather(data: Any) -> Any:
    """Every process's tensors concatenated along the first dimension, in rank order (scalars become 1-d).

    Shapes must agree across processes apart from nothing at all: use `pad_across_processes` first
    when the first dimension may differ.
    """
    if _world() == 1:
        return recurse(lambda t: t[None] if t.ndim == 0 else t, data)
    return recurse(_gather_one, data)


def gather_object(obj: Any) -> list[Any]:
    """Every process's picklable `obj`, as one list in rank order (a list `obj` is flattened)."""
    if _world() == 1:
        return list(obj) if isinstance(obj, list) else [obj]
    out = Peers().all_gather_object(obj, label="gather_object")
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from process `src`, on every process."""
    return Peers().broadcast_object(obj, src=src)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Process `from_process`'s tensors (any nesting), in place on every process; returns `data`."""
    if _world() == 1:
        return data

    def one(t: torch.Tensor) -> torch.Tensor:
        wire = _wire(t)
        sent = t if wire == t.device else t.to(wire)
        with named("broadcast", _rank()):
            dist.broadcast(sent, src=from_process)
        if sent is not t:
            t.copy_(sent)
        return t

    return recurse(one, data)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """`object_list` filled, in place, with process `from_process`'s picklable objects; returns it."""
    if _world() > 1:
        with named("broadcast_object_list", _rank()):
            dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum (or mean) of every process's tensors, on every process, times `scale`."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none' (got {reduction!r})")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if _world() > 1 and reduction != "none":
            wire = _wire(t)
            sent = out if wire == t.device else out.to(wire)
            with named("reduce", _rank()):
                dist.all_reduce(sent)
            out = sent.to(t.device)
            if reduction == "mean":
                out = out / _world()
        return out * scale if scale != 1.0 else out

    return recurse(one, data)


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor along `dim` to the largest size any process has, so that `gather` can stack them.
    A tensor without that dimension is returned as it is, as Accelerate does: Trainer pads every label
    tensor along dim 1, and a classifier's labels have one dimension."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if _world() == 1 or not -t.ndim <= dim < t.ndim:
            return t
        d = dim if dim >= 0 else t.ndim + dim
        size = torch.tensor([t.shape[d]], device=t.device)
        sizes = _gather_one(size)
        longest = int(sizes.max())
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return recurse(one, data)


def truncate(data: Any, count: int) -> Any:
    """The first `count` rows of every tensor (drops the samples a dataloader repeated to even out batches)."""
    return recurse(lambda t: t[:count] if t.ndim else t, data)
