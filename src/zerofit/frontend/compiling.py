"""`torch.compile` with a prepared model: `Accelerator(dynamo_backend=...)` compiles in place after the engine's hooks.

[Note: compiling a prepared model]
The engine changes the model in place and drives it through module hooks, gradient hooks and storage
that stage 3 frees and refills (zerofit.engine.stage3). Every way a script compiles works and trains
as the eager model does (2 gloo ranks, stages 0-3, with and without a host-stepped optimizer, fp32
and bf16 autocast: equal losses); they differ only in what the script holds afterwards:
- `model.compile()` (before or after `prepare()`), or `Accelerator(dynamo_backend=...)`, which calls
  it at the end of `prepare()`: the model stays the script's own object, dynamo sees the hooks at call time,
  so the order against `prepare()` does not matter. Recommended.
- `torch.compile(model)` before `prepare()`: `prepare()` shards the module inside the wrapper
  (`_orig_mod`) and returns the wrapper, so saved names carry no `_orig_mod.` prefix.
- `torch.compile(model)` after `prepare()`: the wrapper is a new object; the Accelerator's calls that
  take the model look through it to the prepared module.
The engine's own hooks run eagerly, outside dynamo (see [Note: hooks under torch.compile] in
zerofit.engine.stage3): stages 0-2, offloaded or not, compile into one graph; stage 3 breaks it at every
unit's gather and release, and a block class's forward is one graph shared by all its blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from zerofit.engine import ZeroEngine

# Accelerate's `DynamoBackend` names that mean "do not compile".
_OFF = (None, "", "no", "none")


def compile_options(dynamo_backend: Any = None, dynamo_plugin: Any = None) -> dict[str, Any] | None:
    """`model.compile` keyword arguments from Accelerate's `dynamo_backend` (a name or its `DynamoBackend`
    enum) or a `TorchDynamoPlugin`-like object (`backend`, `mode`, `fullgraph`, `dynamic`, `options`);
    None when neither asks for compiling."""
    plugin = dynamo_plugin
    if plugin is not None and not isinstance(plugin, dict):
        plugin = dataclasses.asdict(plugin) if dataclasses.is_dataclass(plugin) else vars(plugin)
    source = plugin or {}
    backend = source.get("backend", dynamo_backend) if plugin is not None else dynamo_backend
    backend = getattr(backend, "value", backend)  # an enum member: its name string
    if isinstance(backend, str):
        backend = backend.lower()
    if backend in _OFF or source.get("disable"):
        return None
    if not isinstance(backend, str) and not callable(backend):
        raise ValueError(f"Accelerator(dynamo_backend={backend!r}): name a torch.compile backend (for example "
                         "'inductor' or 'aot_eager'), or 'no' to run uncompiled")
    out: dict[str, Any] = {"backend": backend}
    for key in ("mode", "fullgraph", "dynamic", "options"):
        value = source.get(key)
        if value is not None and not (key == "mode" and value == "default") and not (key == "fullgraph" and not value):
            out[key] = value
    return out


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a `torch.compile` wrapper (`OptimizedModule`), else `model` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def compile_prepared(model: nn.Module, options: dict[str, Any], engine: ZeroEngine) -> None:
    """Compile `model` in place (`nn.Module.compile`), after `engine` installed its hooks
    (see [Note: compiling a prepared model])."""
    hooked = ("zero_optimization stage 3 (its parameter gathers)" if engine.shards_parameters
              else "an offloaded optimizer (its wait before a unit runs)" if engine.offload.host or engine.offload.gpu
              else None)
    if options.get("fullgraph") and hooked is not None:
        raise ValueError(f"dynamo_plugin fullgraph=True cannot hold {hooked}: the engine's hooks run between "
                         "graphs; set fullgraph=False (the model's code is compiled between the hooks)")
    model.compile(**options)
