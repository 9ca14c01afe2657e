"""`torch.compile` with a prepared model: `Accelerator(dynamo_backend=...)`, else the config's `compile` section (an
Accelerate YAML's `dynamo_config`), compiles in place after the engine's hooks, whole or block by block.

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

[Note: who asks for compiling]
`accelerate launch` hands a YAML's `dynamo_config` to its workers as ACCELERATE_DYNAMO_* variables, which
Accelerate's Accelerator reads only where the script passed no `dynamo_backend` / `dynamo_plugin`. zerofit
reads `dynamo_config` into the config's `compile` section, which reaches the workers with the rest of the
resolved config, and keeps that precedence: the section applies when the script passes neither argument,
and an argument replaces the whole section (`dynamo_backend="no"`: eager). transformers' Trainer passes
`dynamo_plugin` only for `--torch_compile`, so its model is compiled once either way; a model the script
compiled itself (`model.compile()`, `torch.compile(model)`) is not compiled again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig
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


@dataclass(frozen=True)
class CompileRequest:
    """How `prepare()` compiles each model it prepares."""

    options: dict[str, Any]
    """`model.compile` keyword arguments."""
    regional: bool = False
    """Compile each unit's module and the modules around them one by one instead of the whole model."""
    fullgraph_name: str = "dynamo_plugin fullgraph=True"
    """The setting that asked for fullgraph, as the user wrote it (for the error when hooks forbid it) ..."""
    fullgraph_fix: str = "set fullgraph=False"
    """... and how to turn it off."""


def requested(dynamo_backend: Any, dynamo_plugin: Any, config: RunConfig) -> CompileRequest | None:
    """What the script's arguments, else the config's `compile` section, ask for (see [Note: who asks for
    compiling]); None: run eagerly."""
    if dynamo_backend is not None or dynamo_plugin is not None:
        options = compile_options(dynamo_backend, dynamo_plugin)
        regional = (dynamo_plugin.get("use_regional_compilation") if isinstance(dynamo_plugin, dict)
                    else getattr(dynamo_plugin, "use_regional_compilation", False))
        return None if options is None else CompileRequest(options, regional=bool(regional))
    section = config.compile
    options = compile_options(dynamo_plugin={"backend": section.backend, "mode": section.mode,
                                             "fullgraph": section.fullgraph, "dynamic": section.dynamic})
    if options is None:
        return None
    name = key_name(config.source_format, "compile.fullgraph")
    return CompileRequest(options, regional=section.regional, fullgraph_name=f"{name} true",
                          fullgraph_fix=f"set {name} to false")


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a `torch.compile` wrapper (`OptimizedModule`), else `model` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def is_compiled(wrapper: nn.Module) -> bool:
    """Whether the script compiled this model itself: a `torch.compile` wrapper, or `model.compile()` in place."""
    return uncompiled(wrapper) is not wrapper or getattr(wrapper, "_compiled_call_impl", None) is not None


def _regions(module: nn.Module, units: set[int]) -> list[nn.Module]:
    """The modules regional compiling compiles: every unit's module (a repeated block, a large module), and the
    largest subtrees holding no unit (what runs between them: embeddings, the final norm, the head)."""
    found: list[nn.Module] = []
    for child in module.children():
        if id(child) in units or not any(id(m) in units for m in child.modules()):
            found.append(child)
        else:
            found.extend(_regions(child, units))
    return found


def compile_prepared(wrapper: nn.Module, model: nn.Module, request: CompileRequest, engine: ZeroEngine) -> None:
    """Compile `model` in place (`nn.Module.compile`), after `engine` installed its hooks (see [Note: compiling a
    prepared model]); nothing when the script compiled it already (`wrapper` is what it passed to `prepare()`)."""
    hooked = ("zero_optimization stage 3 (its parameter gathers)" if engine.shards_parameters
              else "an offloaded optimizer (its wait before a unit runs)" if engine.offload.host or engine.offload.gpu
              else None)
    if request.options.get("fullgraph") and hooked is not None:
        raise ValueError(f"{request.fullgraph_name} cannot hold {hooked}: the engine's hooks run between "
                         f"graphs; {request.fullgraph_fix} (the model's code is compiled between the hooks)")
    if is_compiled(wrapper):
        return
    if not request.regional:
        model.compile(**request.options)
        return
    units = {id(unit.module) for unit in engine.units if unit.module is not model}
    for region in _regions(model, units) if units else [model]:
        region.compile(**request.options)
