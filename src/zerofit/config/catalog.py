"""The optimizers, learning-rate schedules and torch.compile backends a config may name, and the arguments
each takes.

Configs name them as DeepSpeed does (`"type": "AdamW"`, `"type": "WarmupDecayLR"`). Knowing each
one's arguments lets validation catch a misspelt `warmup_num_step` before a run starts rather than
as a TypeError on every rank after the model has loaded.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

REQUIRED: Any = object()
"""Marks a schedule parameter without a default."""

SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupDecayLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "OneCycle": {
        "cycle_min_lr": REQUIRED,
        "cycle_max_lr": REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
        "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
        "last_batch_iteration": -1,
    },
}
"""Schedule type -> parameter -> default (DeepSpeed's names and defaults)."""

DEEPSPEED_ONLY_OPTIMIZERS = (
    "OneBitAdam",
    "ZeroOneAdam",
    "Lamb",
    "OneBitLamb",
    "Muon",
    "FusedAdam",
    "CPUAdam",
    "FusedLamb",
)
"""DeepSpeed optimizers with no torch.optim counterpart zerofit could substitute."""


def schedule_name(name: str) -> str | None:
    """The canonical spelling of a schedule type, matched without regard to case."""
    for known in SCHEDULES:
        if known.lower() == name.lower():
            return known
    return None


@functools.cache
def _torch_optimizers() -> dict[str, type]:
    import torch.optim  # imported here: configs are read by the launcher before torch is needed

    return {
        name: cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }


def optimizer_class(name: str) -> type | None:
    """The torch.optim class a config's optimizer type names (`adamw`, `AdamW` and `ADAMW` alike)."""
    for known, cls in _torch_optimizers().items():
        if known.lower() == name.lower():
            return cls
    return None


def optimizer_names() -> list[str]:
    return sorted(_torch_optimizers())


def optimizer_arguments(cls: type) -> set[str] | None:
    """Constructor arguments other than `params`; None when the class takes arbitrary keywords."""
    signature = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return {name for name in signature.parameters if name not in ("self", "params")}


_DEBUG_BACKENDS = ("eager", "aot_eager")
"""Backends `torch._dynamo.list_backends()` hides as debugging aids that are worth naming: they compile
nothing, so they show what dynamo captures (and test it) at eager speed."""


@functools.cache
def compile_backends() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every `torch.compile` backend name this torch knows, the ones to suggest): imported here, and only
    for a config that compiles, because `torch._dynamo` takes about a second to import."""
    import torch._dynamo

    suggested = sorted({*torch._dynamo.list_backends(), *_DEBUG_BACKENDS})
    return tuple(torch._dynamo.list_backends(exclude_tags=())), tuple(suggested)
