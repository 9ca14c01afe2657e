"""`module.load_state_dict()` on a prepared model: the values reach the fp32 masters and the shards.

[Note: loading a state dict into the engine]
After `prepare()` the weights that training continues from are the engine's: the fp32 masters of
trainable parameters (the model's own parameters are rebuilt from them after every step) and the
shards of frozen ones. torch's `load_state_dict` copies into the model's parameters only, so under
mixed precision a load was undone by the next step (the masters overwrote it), and under stage 3 it
copied into parameters whose storage had been released (a segmentation fault). The engine therefore
puts two documented load hooks on every module of the model, the root and each submodule alike:
- before the walk (`register_load_state_dict_pre_hook`, on the module `load_state_dict` was called
  on), each key that names a parameter of the engine is checked for shape, this rank's part of it is
  written into the master (trainable) or the shard (frozen), and the key is taken out of the dict, so
  torch copies nothing into the parameter;
- after the walk (`register_load_state_dict_post_hook`, same module), the keys taken are removed from
  the missing keys torch listed, and the model's parameters are rebuilt from the masters.
Every rank writes its own part from its own copy of the full dict; rebuilding the parameters
all-gathers at stages 1-3, so the call is collective there (every rank calls `load_state_dict`, as
every rank built the model). Buffers load as torch loads them. Only the outermost call of a walk
acts: children's hooks see an open walk whose prefix theirs extends and leave it alone.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from zerofit.engine.full_state import inside_walk
from zerofit.engine.state import local_fragments


class FullStateLoad:
    """The two load hooks of every module of a prepared model (see the note above)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._open: tuple[nn.Module, str, list[str]] | None = None
        """The walk being served: (its outermost module, its prefix, the keys taken out of the dict)."""

    def install(self) -> None:
        for module in self.engine.model.modules():
            module.register_load_state_dict_pre_hook(lambda *a: self._before(*a))
            module.register_load_state_dict_post_hook(lambda *a: self._after(*a))

    def _before(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any, _strict: bool,
                _missing: list[str], _unexpected: list[str], error_msgs: list[str]) -> None:
        if inside_walk(self._open, prefix):
            return
        self._open = (module, prefix, self._take(module, state_dict, prefix, error_msgs))

    def _after(self, module: nn.Module, incompatible: Any) -> None:
        if self._open is None or self._open[0] is not module:
            return
        taken, self._open = set(self._open[2]), None
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]
        # every group written was published from its master by `_take` (the others' shards are their masters'
        # rounding already): gather only, and join no group kept packed or on file
        with self.engine.state_by_group():
            self.engine.refresh_params(published=True)

    def _take(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]) -> list[str]:
        """Write this rank's part of every engine parameter `state_dict` holds; return the keys taken out."""
        engine = self.engine
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            keys.setdefault(id(p), []).append(name)
        source: dict[str, torch.Tensor] = {}  # the engine's name of a parameter -> the value given for it
        taken: list[str] = []
        for g in engine.groups:
            for name, p, shape in zip(g.names, g.params, g.shapes):
                given = [k for k in keys.get(id(p), ()) if k in state_dict]
                if not given:
                    continue
                key = given[-1]  # a tied weight given under several names: the last copy wins, as in torch
                value = state_dict[key]
                if tuple(value.shape) != tuple(shape):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                      f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                                      f"{tuple(shape)}.")
                    continue
                source[name] = value
                for k in given:  # a tied weight's every name: torch must copy none of them
                    state_dict.pop(k)
                    taken.append(k)
        if not source:
            return taken
        # nothing in flight before it is written; a group kept packed or on file is brought in alone, written, and
        # its parameters published from it before it goes back (one such group in host memory at a time)
        with engine.state_by_group(write=True) as scope, torch.no_grad():
            for g in engine.groups:
                if not any(name in source for name in g.names):
                    continue
                with scope(g) or contextlib.nullcontext():
                    for f in local_fragments([g], engine.optimizer, rank=0):  # rank 0: replicas included
                        value = source.get(f.name)
                        if value is None:
                            continue
                        part = value.detach().reshape(-1)[f.start:f.start + f.length]
                        target = f.tensors["master"] if f.trainable else f.tensors["param"]
                        target.copy_(part.to(device=target.device, dtype=target.dtype))
                    g.publish_master()  # `_after` gathers them
        return taken
