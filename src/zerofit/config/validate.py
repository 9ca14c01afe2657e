"""Cross-field rules of a RunConfig, all checked at once.

Every rule is a small function that appends `Problem`s; `validate_config` runs them all and raises
one `ConfigError` listing every problem, so a user fixes a config in one pass instead of one launch
per mistake. Messages name keys through `naming.key_name`, in the spelling of the file the user
wrote, and end with the fix. Values that are still AUTO are skipped: `auto.resolve_auto` fills them
and validates again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_args

from ..errors import ConfigError
from . import catalog
from .naming import key_name, turn_off
from .reading import did_you_mean
from .schema import CommunicationDataType, MixedPrecision, OffloadDevice, RunConfig, is_auto
from .tree import flatten

_OFFLOAD_DEVICES = get_args(OffloadDevice)
_MIXED_PRECISIONS = get_args(MixedPrecision)
_COMMUNICATION_DATA_TYPES = get_args(CommunicationDataType)


def _one_of(choices: tuple[str, ...]) -> str:
    """`("a", "b", "c")` as "a, b or c"."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]


@dataclass(frozen=True)
class Problem:
    """One broken rule, and the zerofit keys it involves (to drop repeats of a rejected value)."""

    message: str
    keys: tuple[str, ...]


class _Checker:
    """Collects problems for one config, naming keys in its source format."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.values = flatten(config)
        self.problems: list[Problem] = []

    def name(self, key: str) -> str:
        return key_name(self.config.source_format, key)

    def add(self, message: str, *keys: str) -> None:
        self.problems.append(Problem(message, keys))

    def known(self, key: str) -> Any:
        """The value at `key`, or None when it is AUTO (not known until the script runs)."""
        value = self.values[key]
        return None if is_auto(value) else value


def _stage(c: _Checker) -> None:
    stage = c.values["zero.stage"]
    if is_auto(stage):
        return  # the planner picks it at prepare() (zerofit.frontend.planning.auto_plan)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        c.add(f"{c.name('zero.stage')} must be 0, 1, 2 or 3 (got {stage!r}): pick one of them, or \"auto\" to "
              "let zerofit pick the fastest that fits", "zero.stage")


def _offload(c: _Checker) -> None:
    stage = c.values["zero.stage"]
    fmt = c.config.source_format
    for kind in ("offload_optimizer", "offload_param"):
        key = f"zero.{kind}"
        device = c.values[f"{key}.device"]
        if is_auto(device):
            continue  # the planner picks none or cpu at prepare()
        if device not in _OFFLOAD_DEVICES:
            c.add(f"{c.name(key + '.device')} must be {_one_of(_OFFLOAD_DEVICES)} (got {device!r})", f"{key}.device")
            continue
        if device == "none":
            continue
        if kind == "offload_param" and device == "nvme":
            c.add(
                f"{c.name(key + '.device')} 'nvme' is not supported: zerofit offloads parameters to the CPU only; "
                f"set it to cpu (NVMe offload is supported for {c.name('zero.offload_optimizer.device')})",
                f"{key}.device",
            )
            continue
        needed = 3 if kind == "offload_param" or device == "nvme" else 1
        if isinstance(stage, int) and stage < needed:
            what = c.name(key) + (" to nvme" if kind == "offload_optimizer" and device == "nvme" else "")
            rule, target = ("stage 3", "3") if needed == 3 else ("stage 1 or higher", "1, 2 or 3")
            c.add(
                f"{what} requires {rule} (got stage {stage}): set {c.name('zero.stage')} to {target} "
                f"or {turn_off(fmt, key)}",
                "zero.stage",
                f"{key}.device",
            )
        nvme_path = c.values[f"{key}.nvme_path"]
        if device == "nvme" and isinstance(nvme_path, str) and os.path.isfile(nvme_path):
            c.add(f"{c.name(key + '.nvme_path')} {nvme_path!r} is a file: point it at a directory on a fast "
                  "local NVMe drive", f"{key}.nvme_path")
        if device == "nvme" and not nvme_path:
            c.add(
                f"{c.name(key + '.nvme_path')} is required when {c.name(key + '.device')} is nvme: "
                "set it to a directory on a fast local NVMe drive",
                f"{key}.nvme_path",
                f"{key}.device",
            )
    _host_share(c)
    if c.values.get("zero.offload_param.step_on", "auto") != "auto":
        c.add(f"{c.name('zero.offload_param.step_on')} is only for the optimizer state (got "
              f"{c.values['zero.offload_param.step_on']!r}): remove it, or set zero.offload_optimizer.step_on",
              "zero.offload_param.step_on")
    ratio = c.values["zero.offload_optimizer.ratio"]
    if isinstance(ratio, (int, float)) and not 0 < ratio <= 1:
        c.add(
            f"{c.name('zero.offload_optimizer.ratio')} must be in (0, 1] (got {ratio}): "
            "1.0 steps every parameter on the CPU",
            "zero.offload_optimizer.ratio",
        )


def _open(share) -> bool:
    return share is None or is_auto(share)


def _host_share(c: _Checker) -> None:
    """`offload_optimizer.host_share`: a share in [0, 1], for the optimizer state, under step_on auto."""
    if not _open(c.values.get("zero.offload_param.host_share")):
        c.add(f"{c.name('zero.offload_param.host_share')} is only for the optimizer state (got "
              f"{c.values['zero.offload_param.host_share']!r}): remove it, or set zero.offload_optimizer.host_share",
              "zero.offload_param.host_share")
    share = c.values.get("zero.offload_optimizer.host_share")
    if _open(share):
        return
    key = c.name("zero.offload_optimizer.host_share")
    if not 0 <= share <= 1:
        c.add(f"{key} must be in [0, 1] (got {share}): the share of the offloaded optimizer state stepped on the "
              "host (0: all on the GPU, 1: all on the host)", "zero.offload_optimizer.host_share")
        return
    step_on = c.values.get("zero.offload_optimizer.step_on", "auto")
    if step_on == "host" and share != 1:
        c.add(f"{key} {share} contradicts {c.name('zero.offload_optimizer.step_on')} 'host' (all of the state on the "
              "host): a share splits GPU-stepped state between host and GPU; remove one of them, or set step_on "
              "to auto or device", "zero.offload_optimizer.host_share", "zero.offload_optimizer.step_on")


# zerofit key -> smallest allowed value; checked only when the value is a known int.
MINIMUMS = {
    "zero.param_persistence_threshold": 0,
    "zero.unit_size_threshold": 1,
    "zero.max_live_parameters": 0,
    "zero.offload_optimizer.buffer_count": 1,
    "zero.offload_param.buffer_count": 1,
    "zero.aio.block_size": 1,
    "zero.aio.queue_depth": 1,
    "zero.aio.thread_count": 1,
    "batch.train_batch_size": 1,
    "batch.train_micro_batch_size_per_gpu": 1,
    "batch.gradient_accumulation_steps": 1,
    "launch.num_processes": 1,
    "launch.num_machines": 1,
    "launch.machine_rank": 0,
    "launch.max_restarts": 0,
    "launch.process_group_timeout": 1,
    "launch.main_process_port": 1,
    "checkpoint.total_limit": 1,
    "logging.steps_per_print": 1,
    "precision.loss_scale.initial_scale_power": 0,
    "precision.loss_scale.loss_scale_window": 1,
    "precision.loss_scale.hysteresis": 1,
}


def _minimums(c: _Checker) -> None:
    for key, least in MINIMUMS.items():
        value = c.known(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < least:
            # "positive" would be wrong for a float such as 0.5 seconds below a minimum of 1
            rule = "positive" if least == 1 and isinstance(value, int) else f"at least {least}"
            c.add(f"{c.name(key)} must be {rule} (got {value}): set it to {least} or more", key)


# Largest values that are still a setting rather than a typo (and that torch accepts: a timedelta of
# 1e300 seconds overflows in every worker).
MAXIMUMS: dict[str, int] = {
    "launch.process_group_timeout": 30 * 24 * 3600,
    "launch.num_processes": 1 << 20,
    "launch.num_machines": 1 << 16,
    "launch.max_restarts": 1 << 16,
    "launch.main_process_port": 65535,
    "batch.train_batch_size": 1 << 30,
    "batch.train_micro_batch_size_per_gpu": 1 << 24,
    "batch.gradient_accumulation_steps": 1 << 20,
}


def _finite_and_bounded(c: _Checker) -> None:
    for key, value in c.values.items():
        if isinstance(value, float) and not math.isfinite(value):
            c.add(f"{c.name(key)} must be a finite number (got {value}): write a number", key)
    for key, most in MAXIMUMS.items():
        value = c.known(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > most:
            shown = f"{value:.3g}" if isinstance(value, float) or value > 10**12 else str(value)
            c.add(f"{c.name(key)} is {shown}, more than the {most} zerofit accepts: set a smaller value", key)


def _optimizer_values(c: _Checker) -> None:
    optimizer = c.config.optimizer
    for arg, value in (optimizer.params.items() if optimizer is not None else ()):
        name = f"optimizer.params.{arg}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_auto(value) or (not number and arg != "betas"):
            continue
        if number and not math.isfinite(value):
            c.add(f"{name} must be a finite number (got {value})", "optimizer.params")
        elif arg in ("lr", "weight_decay", "eps") and number and value < 0:
            c.add(f"{name} must be 0 or more (got {value}): {'1e-4 is a usual lr' if arg == 'lr' else 'write it'}",
                  "optimizer.params")
        elif arg == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
            c.add(f"optimizer.params.betas must be two numbers in [0, 1) (got {value!r}): [0.9, 0.999] is usual",
                  "optimizer.params")


def _launch(c: _Checker) -> None:
    machines, rank = c.known("launch.num_machines"), c.known("launch.machine_rank")
    if isinstance(machines, int) and isinstance(rank, int) and machines >= 1 and rank >= machines:
        c.add(
            f"{c.name('launch.machine_rank')} ({rank}) must be below {c.name('launch.num_machines')} ({machines}): "
            f"machines are numbered 0 to {machines - 1}",
            "launch.machine_rank",
        )
    processes = c.known("launch.num_processes")
    if isinstance(machines, int) and machines > 1:
        if isinstance(processes, int) and processes >= 1 and processes % machines:
            c.add(
                f"{c.name('launch.num_processes')} ({processes}) must be a multiple of "
                f"{c.name('launch.num_machines')} ({machines}): every machine runs the same number of processes",
                "launch.num_processes",
            )
        if not c.values["launch.main_process_ip"] and not c.values.get("launch.hostfile"):  # else its first host
            c.add(
                f"{c.name('launch.main_process_ip')} is required when {c.name('launch.num_machines')} > 1: "
                "set it to the address of machine 0",
                "launch.main_process_ip",
            )
    port = c.known("launch.main_process_port")
    if isinstance(port, int) and port > 65535:
        c.add(
            f"{c.name('launch.main_process_port')} must be a port number up to 65535 (got {port})",
            "launch.main_process_port",
        )


def _precision(c: _Checker) -> None:
    mode = c.values["precision.mixed_precision"]
    if not is_auto(mode) and mode not in _MIXED_PRECISIONS:
        c.add(
            f"{c.name('precision.mixed_precision')} must be {_one_of(_MIXED_PRECISIONS)} (got {mode!r})",
            "precision.mixed_precision",
        )
    wire = c.values["precision.communication_data_type"]
    if wire not in _COMMUNICATION_DATA_TYPES:
        c.add(
            f"{c.name('precision.communication_data_type')} must be {_one_of(_COMMUNICATION_DATA_TYPES)} "
            f"(got {wire!r}): fp32 reduces gradients exactly; bf16 halves the bytes sent",
            "precision.communication_data_type",
        )
    scale, least = c.known("precision.loss_scale.loss_scale"), c.known("precision.loss_scale.min_loss_scale")
    if isinstance(scale, (int, float)) and scale < 0:
        c.add(
            f"{c.name('precision.loss_scale.loss_scale')} must be 0 (dynamic) or a positive static scale (got {scale})",
            "precision.loss_scale.loss_scale",
        )
    if isinstance(least, (int, float)) and least <= 0:
        c.add(
            f"{c.name('precision.loss_scale.min_loss_scale')} must be positive (got {least}): 1 is usual",
            "precision.loss_scale.min_loss_scale",
        )
    power = c.known("precision.loss_scale.initial_scale_power")
    if isinstance(power, int) and power > 64:
        c.add(
            f"{c.name('precision.loss_scale.initial_scale_power')} ({power}) is an exponent of 2 and over 64 overflows "
            "fp32: use 16 to 32",
            "precision.loss_scale.initial_scale_power",
        )


def _clipping(c: _Checker) -> None:
    clip = c.known("gradient_clipping")
    if isinstance(clip, (int, float)) and clip < 0:
        c.add(
            f"{c.name('gradient_clipping')} must be 0 (off) or a positive norm (got {clip}): 1.0 is usual",
            "gradient_clipping",
        )


def _batch(c: _Checker, world_size: int) -> None:
    train, micro, accum = (
        c.known(f"batch.{k}")
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    if not all(isinstance(v, int) and v >= 1 for v in (train, micro, accum)):
        return
    product = micro * accum * world_size
    if train != product:
        n_train, n_micro, n_accum = (
            c.name(f"batch.{k}")
            for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        )
        c.add(
            f"{n_train} ({train}) != {n_micro} ({micro}) * {n_accum} ({accum}) * world size ({world_size}) = "
            f'{product}: set {n_train} to {product} or to "auto"',
            "batch.train_batch_size",
            "batch.train_micro_batch_size_per_gpu",
            "batch.gradient_accumulation_steps",
        )


def _optimizer(c: _Checker) -> None:
    optimizer = c.config.optimizer
    if optimizer is None:
        return
    if not optimizer.type:
        c.add(
            "optimizer.type is missing: name the optimizer (for example AdamW) or remove the optimizer section",
            "optimizer.type",
        )
        return
    cls = catalog.optimizer_class(optimizer.type)
    if cls is None:
        if optimizer.type in catalog.DEEPSPEED_ONLY_OPTIMIZERS:
            why = "is a DeepSpeed optimizer zerofit does not provide"
        else:
            guess = did_you_mean(optimizer.type, catalog.optimizer_names())
            why = f"is not a known optimizer{f' (did you mean {guess}?)' if guess else ''}"
        c.add(
            f"optimizer.type {optimizer.type!r} {why}: use AdamW, Adam, SGD or another torch.optim class name",
            "optimizer.type",
        )
        return
    allowed = catalog.optimizer_arguments(cls)
    if allowed is None:
        return
    for arg in optimizer.params:
        if arg not in allowed:
            guess = did_you_mean(arg, allowed)
            hint = (
                f"did you mean optimizer.params.{guess}?"
                if guess
                else f"it takes {', '.join(sorted(allowed))}"
            )
            c.add(
                f"optimizer.params.{arg} is not an argument of torch.optim.{cls.__name__}: {hint}",
                "optimizer.params",
            )


def _scheduler(c: _Checker) -> None:
    scheduler = c.config.scheduler
    if scheduler is None:
        return
    if not scheduler.type:
        c.add(
            "scheduler.type is missing: name the schedule (for example WarmupLR) or remove the scheduler section",
            "scheduler.type",
        )
        return
    kind = catalog.schedule_name(scheduler.type)
    if kind is None:
        guess = did_you_mean(scheduler.type, catalog.SCHEDULES)
        c.add(
            f"scheduler.type {scheduler.type!r} is not a known schedule{f' (did you mean {guess}?)' if guess else ''}: "
            f"use one of {', '.join(catalog.SCHEDULES)}",
            "scheduler.type",
        )
        return
    spec = catalog.SCHEDULES[kind]
    for arg in scheduler.params:
        if arg not in spec:
            guess = did_you_mean(arg, spec)
            hint = f"did you mean scheduler.params.{guess}?" if guess else f"it takes {', '.join(spec)}"
            c.add(f"scheduler.params.{arg} is not a parameter of {kind}: {hint}", "scheduler.params")
    for arg, default in spec.items():
        if default is catalog.REQUIRED and arg not in scheduler.params:
            c.add(
                f'scheduler.params.{arg} is required by {kind}: set it (or to "auto" to take it from the script)',
                "scheduler.params",
            )
    # DeepSpeed floors warm-up at 2 steps, so 0 and 1 are accepted (the blog's ZeRO-3 JSON writes 0).
    for arg, least in (("warmup_num_steps", 0), ("total_num_steps", 1)):
        value = scheduler.params.get(arg)
        if (
            value is not None
            and not is_auto(value)
            and (not isinstance(value, int) or isinstance(value, bool) or value < least)
        ):
            c.add(
                f"scheduler.params.{arg} must be a whole number >= {least} (got {value!r})", "scheduler.params"
            )


def _compile(c: _Checker) -> None:
    backend = c.values["compile.backend"]
    if not isinstance(backend, str) or backend.lower() in ("no", "none", ""):
        return
    known, suggested = catalog.compile_backends()
    if backend.lower() not in known:
        c.add(f"{c.name('compile.backend')} {backend!r} is not a torch.compile backend of this torch: choose one of "
              f"{', '.join(suggested)} (torch._dynamo.list_backends()), or no to run uncompiled", "compile.backend")


_RULES: tuple[Callable[[_Checker], None], ...] = (
    _stage,
    _offload,
    _minimums,
    _finite_and_bounded,
    _launch,
    _precision,
    _clipping,
    _optimizer,
    _optimizer_values,
    _scheduler,
    _compile,
)


def find_problems(config: RunConfig, *, world_size: int | None = None) -> list[Problem]:
    """Every broken rule of `config`; the batch triple is checked only when the world size is known."""
    checker = _Checker(config)
    for rule in _RULES:
        rule(checker)
    world = world_size if world_size is not None else checker.known("launch.num_processes")
    if isinstance(world, int) and world >= 1:
        _batch(checker, world)
    return checker.problems


def messages(problems: list[Problem], *, skip_keys: set[str] = frozenset()) -> Iterator[str]:
    """Messages of `problems`, leaving out those about keys already reported as unreadable."""
    for problem in problems:
        if not skip_keys.intersection(problem.keys):
            yield problem.message


def validate_config(config: RunConfig, *, world_size: int | None = None) -> None:
    """Raise one ConfigError listing every cross-field problem of `config`; return quietly if none."""
    found = list(messages(find_problems(config, world_size=world_size)))
    if found:
        raise ConfigError(found, config.source)
