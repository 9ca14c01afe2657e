"""Filling "auto" values from what the training script knows, with Accelerate's rules.

A config says "auto" where the right value lives in the script: the DataLoader's batch size, the
`Accelerator(gradient_accumulation_steps=...)` argument, the model's hidden size, `DummyOptim`'s
learning rate. `prepare()` collects those as `ScriptFacts` and calls `resolve_auto`, which

1. fills every AUTO it has a fact for (the table in `_FILLS` says which fact fills which key),
2. derives the missing member of the batch triple as DeepSpeed does,
3. validates the result with the now-known world size,

and raises one ConfigError naming every key it could not fill and where its value would have come
from, together with any rule the filled config breaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import validate
from .naming import key_name
from .schema import RunConfig, ZeroConfig, is_auto
from .tree import build_config, flatten


@dataclass(frozen=True, kw_only=True)
class ScriptFacts:
    """What the running script says about itself; None where it says nothing."""

    micro_batch_size: int | None = None
    """batch_size of the training DataLoader passed to prepare()."""
    gradient_accumulation_steps: int | None = None
    """Accelerator(gradient_accumulation_steps=...)."""
    mixed_precision: str | None = None
    """Accelerator(mixed_precision=...) or --mixed_precision: no, fp16 or bf16."""
    num_processes: int | None = None
    """The world size of the running job."""
    lr: float | None = None
    """DummyOptim(lr=...)."""
    weight_decay: float | None = None
    """DummyOptim(weight_decay=...)."""
    total_num_steps: int | None = None
    """DummyScheduler(total_num_steps=...): optimizer steps this process will take."""
    warmup_num_steps: int | None = None
    """DummyScheduler(warmup_num_steps=...)."""
    hidden_size: int | None = None
    """model.config.hidden_size (or the largest of hidden_sizes)."""


_Fill = Callable[[ScriptFacts], Any]

# zerofit key -> (how the facts fill it, where the value comes from, for the error when they cannot).
_FILLS: dict[str, tuple[_Fill, str]] = {
    "batch.train_micro_batch_size_per_gpu": (
        lambda f: f.micro_batch_size,
        "the batch_size of the training DataLoader passed to prepare()",
    ),
    "batch.gradient_accumulation_steps": (
        lambda f: 1 if f.gradient_accumulation_steps is None else f.gradient_accumulation_steps,
        "Accelerator(gradient_accumulation_steps=...)",
    ),
    "precision.mixed_precision": (
        lambda f: f.mixed_precision,
        "Accelerator(mixed_precision=...) or --mixed_precision",
    ),
    # [Note: gradient_clipping "auto"]
    # The norm a script would pass to clip_grad_norm_ is unknowable before it runs, so "auto" is 1.0,
    # what Accelerate substitutes under DeepSpeed: a config moved from Accelerate clips as it did there.
    # A script that calls accelerator.clip_grad_norm_(max_norm) still gets its max_norm on those steps
    # (the engine clips once per step, with the script's norm when it asked for one).
    "gradient_clipping": (lambda f: 1.0, "1.0"),
    "zero.param_persistence_threshold": (
        lambda f: None if f.hidden_size is None else 10 * f.hidden_size,
        "model.config.hidden_size (10 * hidden_size)",
    ),
}

# Only stage 3 reads these; below it an unfillable "auto" takes the default instead of failing.
_STAGE3_ONLY = {
    "zero.param_persistence_threshold": ZeroConfig().param_persistence_threshold,
}

_OPTIMIZER_FILLS: dict[str, tuple[_Fill, str]] = {
    "lr": (lambda f: f.lr, "DummyOptim(lr=...)"),
    "weight_decay": (lambda f: f.weight_decay, "DummyOptim(weight_decay=...)"),
}
_SCHEDULER_FILLS: dict[str, tuple[_Fill, str]] = {
    "warmup_min_lr": (lambda f: 0.0, "0"),
    "warmup_num_steps": (lambda f: f.warmup_num_steps, "DummyScheduler(warmup_num_steps=...)"),
    "total_num_steps": (lambda f: f.total_num_steps, "DummyScheduler(total_num_steps=...)"),
}


def _unfilled(name: str, origin: str) -> str:
    return f'{name} is "auto" but the script did not supply it: it comes from {origin}; provide that or write a value'


class _Resolution:
    def __init__(self, config: RunConfig, facts: ScriptFacts):
        self.config, self.facts = config, facts
        self.values = flatten(config)
        self.problems: list[str] = []

    def name(self, key: str) -> str:
        return key_name(self.config.source_format, key)

    def fill_leaves(self) -> None:
        for key, (fill, origin) in _FILLS.items():
            if not is_auto(self.values[key]):
                continue
            value = fill(self.facts)
            if value is None and key in _STAGE3_ONLY and self.values["zero.stage"] != 3:
                value = _STAGE3_ONLY[key]
            if value is None:
                self.problems.append(_unfilled(self.name(key), origin))
            else:
                self.values[key] = value

    def fill_params(self, section: str, fills: dict[str, tuple[_Fill, str]]) -> dict[str, Any]:
        params = dict(self.values[f"{section}.params"])
        for arg, value in params.items():
            if not is_auto(value):
                continue
            fill, origin = fills.get(
                arg, (lambda f: None, f"nothing: zerofit fills only {', '.join(fills)} of {section}.params")
            )
            if arg == "warmup_max_lr" and section == "scheduler":
                fill, origin = (lambda f: self._optimizer_lr()), "the optimizer's lr"
            filled = fill(self.facts)
            if filled is None:
                self.problems.append(_unfilled(f"{section}.params.{arg}", origin))
            else:
                params[arg] = filled
        return params

    def _optimizer_lr(self) -> Any:
        lr = self.values.get("optimizer.params", {}).get("lr") if self.config.optimizer else None
        return self.facts.lr if lr is None or is_auto(lr) else lr

    def world_size(self) -> int | None:
        world = self.facts.num_processes or self.values["launch.num_processes"]
        return world if isinstance(world, int) else None

    def derive_batch(self, world: int | None) -> None:
        """DeepSpeed's rule: any two of the triple give the third; micro alone implies one accumulation step.

        An "auto" train_batch_size is simply the product, so it is derived like an absent one.
        """
        v = self.values
        keys = (
            "batch.train_batch_size",
            "batch.train_micro_batch_size_per_gpu",
            "batch.gradient_accumulation_steps",
        )
        if any(is_auto(v[k]) for k in keys[1:]):
            return  # an unfilled micro batch or accumulation was reported already
        train, micro, accum = (None if is_auto(v[k]) else v[k] for k in keys)
        if None not in (train, micro, accum):
            return  # nothing to derive; validation checks the product against the world size
        n_train, n_micro, n_accum = (self.name(k) for k in keys)
        if micro is None and train is None:
            micro = self.facts.micro_batch_size
            if micro is None:
                self.problems.append(
                    f"{n_train} and {n_micro} are both unset: set one of them, or pass a DataLoader with a "
                    "batch_size to prepare()"
                )
                return
        if world is None:
            self.problems.append(
                f"the world size is unknown, so the batch triple ({n_train}, {n_micro}, {n_accum}) cannot be "
                "completed: set num_processes or run under the launcher"
            )
            return
        if accum is None:
            if train is not None and micro is not None:
                if train % (micro * world):
                    self.problems.append(
                        f"{n_train} ({train}) is not a multiple of {n_micro} ({micro}) * world size ({world}) = "
                        f"{micro * world}, so {n_accum} cannot be derived: set {n_accum} or make {n_train} a "
                        f"multiple of {micro * world}"
                    )
                    return
                accum = train // (micro * world)
            else:
                accum = 1
        if micro is None:
            if train % (accum * world):
                self.problems.append(
                    f"{n_train} ({train}) is not a multiple of {n_accum} ({accum}) * world size ({world}) = "
                    f"{accum * world}, so {n_micro} cannot be derived: set {n_micro} or make {n_train} a "
                    f"multiple of {accum * world}"
                )
                return
            micro = train // (accum * world)
        if train is None:
            train = micro * accum * world
        v.update(zip(keys, (train, micro, accum), strict=True))


def resolve_auto(config: RunConfig, facts: ScriptFacts) -> RunConfig:
    """`config` with every AUTO filled from `facts` and the batch triple completed, validated with the world size.

    Raises one ConfigError listing every key still "auto" (with where its value would come from) and
    every rule the filled config breaks.
    """
    resolution = _Resolution(config, facts)
    resolution.fill_leaves()
    world = resolution.world_size()
    resolution.derive_batch(world)
    if config.optimizer is not None:
        resolution.values["optimizer.params"] = resolution.fill_params("optimizer", _OPTIMIZER_FILLS)
    if config.scheduler is not None:
        resolution.values["scheduler.params"] = resolution.fill_params("scheduler", _SCHEDULER_FILLS)
    resolved = build_config(resolution.values)
    found = resolution.problems + list(validate.messages(validate.find_problems(resolved, world_size=world)))
    if found:
        raise ConfigError(found, config.source)
    return resolved
