"""Learning-rate schedules a config may name, as `torch.optim.lr_scheduler.LRScheduler` subclasses.

The five schedules DeepSpeed configs name (`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`,
`LRRangeTest`) with DeepSpeed's parameter names, defaults and formulas, written as closed forms of
the step count, so `state_dict()` / `load_state_dict()` and resuming work like any torch scheduler.

[Note: step numbering]
DeepSpeed's schedules count `last_batch_iteration` from -1 (constructed, not stepped yet); torch's
count `last_epoch` from 0 after construction (torch takes one step in `__init__`). Here
`iteration = last_epoch - 1`, so the learning rate after construction and after every `step()` is
exactly the one DeepSpeed's schedule gives at the same point of a run.

`build_scheduler` turns a config's `scheduler` section into one of these; `AcceleratedScheduler`
wraps any scheduler so that `scheduler.step()` in a script only moves it when the optimizer stepped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zerofit.config.schema import SchedulerConfig
from zerofit.errors import ConfigError

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    """One value per param group: a scalar repeated, or a list with exactly one entry per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} param groups: "
                             f"give one value, or one per param group")
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """How far warm-up has come at `iteration` (0 .. 1): log(iteration + 1) / log(steps), or linear."""
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps < 0:
        raise ValueError(f"warmup_num_steps must be a whole number >= 0 (got {warmup_num_steps!r})")
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be 'log' or 'linear' (got {warmup_type!r})")
    return max(2, warmup_num_steps)  # DeepSpeed's floor: log warm-up divides by log(steps)


class _IterationSchedule(LRScheduler):
    """A schedule given as `lrs_at(iteration)`, DeepSpeed's iteration numbering (see the module note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1):
        super().__init__(optimizer)
        if last_batch_iteration != -1:  # resuming from a DeepSpeed-style iteration count
            self.last_epoch = last_batch_iteration + 1
            for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
                group["lr"] = lr
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
            self.step_hook()

    def step(self, epoch: int | None = None) -> None:  # noqa: D102 - torch's signature
        super().step(epoch)
        self.step_hook()

    def step_hook(self) -> None:
        """Settings other than lr that follow the schedule (OneCycle's momentum)."""

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_IterationSchedule):
    """From `warmup_min_lr` up to `warmup_max_lr` over `warmup_num_steps` (log or linear), then flat."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:  # DeepSpeed: the optimizer's own (first group's) lr
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        g = self.gamma(iteration)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then linear decay from `warmup_max_lr` to `warmup_min_lr` at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive whole number (got {total_num_steps!r})")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_IterationSchedule):
    """A ratio of each group's lr: warm-up from `warmup_min_ratio` to 1, then cosine down to `cos_min_ratio`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive whole number (got {total_num_steps!r})")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            up = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + up * (1.0 - self.warmup_min_ratio)
        progress = (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(1.0, progress))) / 2.0  # stays at the floor past the end
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        r = self.ratio(iteration)
        return [lr * r for lr in self.org_lrs]


class OneCycle(_IterationSchedule):
    """One triangular cycle `cycle_min_lr` -> `cycle_max_lr` -> `cycle_min_lr` (optionally in stairs), then decay.

    With `cycle_momentum`, the first Adam beta moves the opposite way between `cycle_max_mom` and
    `cycle_min_mom` (optimizers without `betas` keep their momentum, as in DeepSpeed). The second
    beta keeps the optimizer's value (DeepSpeed pins it to 0.99).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_size
        if self.first_size <= 0 or self.second_size <= 0:
            raise ValueError(f"cycle_first_step_size and cycle_second_step_size must be positive "
                             f"(got {cycle_first_step_size!r}, {cycle_second_step_size!r})")
        self.total_size = self.first_size + self.second_size
        self.step_ratio = self.first_size / self.total_size
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.min_mom, self.max_mom = float(cycle_min_mom), float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        super().__init__(optimizer, last_batch_iteration)

    def scale(self, iteration: int) -> float:
        """Position in the cycle: 0 at either end, 1 at the peak."""
        n = iteration + 1
        x = 1.0 + n / self.total_size - math.floor(1 + n / self.total_size)
        if x <= self.step_ratio:
            factor, stairs = x / self.step_ratio, self.first_stairs
        else:
            factor, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:  # quantise from the integer offset, so a half-cycle's end is exactly a stair
            at = n % self.total_size
            position = at * stairs / self.first_size if at <= self.first_size \
                else (self.total_size - at) * stairs / self.second_size
            factor = math.floor(position) / stairs
        return factor

    def _decay_interval(self, iteration: int) -> float | None:
        """Decay intervals passed after the cycle, or None while cycling or when decay is off."""
        if iteration < self.total_size or math.isclose(self.decay_step_size, 0):
            return None
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            s = self.scale(iteration)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        interval = self._decay_interval(iteration)
        if interval is None or math.isclose(self.decay_lr_rate, 0):
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def momentum_at(self, iteration: int) -> float:
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale(iteration)
        interval = self._decay_interval(iteration)
        if interval is None or math.isclose(self.decay_mom_rate, 0):
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * interval)

    def step_hook(self) -> None:
        if self.cycle_momentum:
            mom = self.momentum_at(self.last_epoch - 1)
            for group in self.optimizer.param_groups:
                group["betas"] = (mom, group["betas"][1])


class LRRangeTest(_IterationSchedule):
    """`lr_range_test_min_lr * (1 + step_rate * iteration_fraction)`, continuous or in stairs."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be positive (got {lr_range_test_step_size!r})")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULE_CLASSES: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The schedule a resolved config's `scheduler` section names, on `optimizer`."""
    cls = next((c for name, c in SCHEDULE_CLASSES.items() if name.lower() == config.type.lower()), None)
    if cls is None:
        raise ConfigError(f"scheduler.type {config.type!r} is not a known schedule: use one of "
                          f"{', '.join(SCHEDULE_CLASSES)}")
    try:
        return cls(optimizer, **config.params)
    except (TypeError, ValueError) as bad:
        raise ConfigError(f"scheduler {config.type} with params {config.params}: {bad}: fix scheduler.params") \
            from None


class AcceleratedScheduler:
    """A script's scheduler, stepped only when the optimizer really stepped.

    `scheduler.step()` in the training loop is a no-op on micro-steps that do not close an
    accumulation window and after an fp16-overflow skip. Otherwise it advances `steps_per_call`
    times: the number of processes for a scheduler the script built (Accelerate's rule: its
    dataloader lengths, and so its step counts, were those of the unsharded data, unless
    `split_batches`), once for a schedule the config named (DeepSpeed's rule, with
    `total_num_steps` "auto" already divided by the number of processes).
    """

    def __init__(self, scheduler: Any, optimizers: Callable[[], list[Any]], *, sync_gradients: Callable[[], bool],
                 steps_per_call: int = 1, step_with_optimizer: bool = True):
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._sync_gradients = sync_gradients
        self.steps_per_call = steps_per_call
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._sync_gradients() or any(opt.step_was_skipped for opt in self._optimizers()):
            return
        for _ in range(self.steps_per_call):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
