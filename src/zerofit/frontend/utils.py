"""What scripts import from `accelerate.utils`, under the same names: seeds, placeholders, small helpers.

`DummyOptim` and `DummyScheduler` stand for the optimizer and schedule the config names; `prepare()`
replaces them (see `zerofit.frontend.accelerator`). The signatures match Accelerate's, so scripts only change
the import. The configuration objects scripts pass to `Accelerator(...)` are `zerofit.frontend.plugins`;
the process helpers (`PartialState`) `zerofit.frontend.processes`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import inspect
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.frontend.ops import (
    broadcast,
    broadcast_object,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from zerofit.frontend.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from zerofit.frontend.processes import PartialState
from zerofit.frontend.state import DistributedType

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "init_empty_weights",
    "init_on_device",
    "is_deepspeed_available",
    "is_npu_available",
    "is_schedulefree_available",
    "is_xpu_available",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
    "tqdm",
    "write_basic_config",
]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (CPU and every GPU).

    `device_specific` adds the process index, so each process draws differently; `deterministic`
    asks torch for deterministic algorithms.
    """
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


class DummyOptim:
    """Placeholder for the optimizer the config's `optimizer` section names.

    `lr` and `weight_decay` fill that section's "auto" values; `params` (tensors or param groups)
    are what the real optimizer will optimise.
    """

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"DummyOptim(lr={self.lr}, weight_decay={self.weight_decay})"


class DummyScheduler:
    """Placeholder for the schedule the config's `scheduler` section names.

    `total_num_steps` and `warmup_num_steps` fill that section's "auto" values. With
    `lr_scheduler_callable`, the config names only the optimizer and `lr_scheduler_callable(optimizer)`
    builds the schedule once the real optimizer exists.
    """

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Callable[[Any], Any] | None = None, **kwargs: Any):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"DummyScheduler(total_num_steps={self.total_num_steps}, warmup_num_steps={self.warmup_num_steps})"


@dataclass
class ProjectConfiguration:
    """Where a run writes: `project_dir`, `logging_dir`, and checkpoint naming (Accelerate's fields)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Modules built inside the block put their tensors on `device` (torch's own device context).

    Buffers go to `device` too, whatever `include_buffers` says: zerofit's engine gives a model built on
    the meta device its buffers back when it materialises it (`zerofit.engine.materialize`)."""
    with torch.device(device):
        yield


def init_empty_weights(include_buffers: bool | None = None) -> contextlib.AbstractContextManager[None]:
    """Build a model without allocating its weights: everything is created on the meta device, and
    `prepare()` materialises only this rank's shards (see `init_on_device` for buffers)."""
    return init_on_device(torch.device("meta"), include_buffers=include_buffers)


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128) -> Callable:
    """Decorator: call `function(batch_size, ...)` from `starting_batch_size`, halving it after each
    out-of-memory error (memory freed in between), until a call succeeds; the decorated function is
    called without the batch size. zerofit's engine also backs off by itself inside `accumulate()`."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size)
    params = list(inspect.signature(function).parameters)
    if not params:
        raise TypeError(f"{function.__name__} must take the batch size as its first argument")

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(args) + 1 > len(params) and not any(
                p.kind is p.VAR_POSITIONAL for p in inspect.signature(function).parameters.values()):
            raise TypeError(f"call {function.__name__}() without the batch size: find_executable_batch_size "
                            f"passes it as {params[0]!r}")
        batch_size = starting_batch_size
        while True:
            if batch_size < 1:
                raise RuntimeError(f"{function.__name__}: no batch size fits in memory (tried down to 1 from "
                                   f"{starting_batch_size})")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only out-of-memory errors are retried
                if not _out_of_memory(e):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size //= 2

    return run


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm`, shown on each machine's local main process only (unless `main_process_only=False`)."""
    from tqdm.auto import tqdm as bar

    if main_process_only and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        kwargs["disable"] = True
    return bar(*args, **kwargs)


def is_deepspeed_available() -> bool:
    """Whether the `deepspeed` package can be imported (zerofit itself never needs it)."""
    return importlib.util.find_spec("deepspeed") is not None


def is_npu_available(check_device: bool = False) -> bool:
    """False: zerofit computes on CUDA GPUs or on the CPU, never on an Ascend NPU, so a script's NPU
    branch (memory counters, cache clearing) must not run even where torch_npu is installed."""
    return False


def is_xpu_available(check_device: bool = False) -> bool:
    """False: zerofit computes on CUDA GPUs or on the CPU, never on an Intel XPU (see `is_npu_available`)."""
    return False


def is_schedulefree_available() -> bool:
    """Whether the `schedulefree` package (schedule-free optimizers) can be imported."""
    return importlib.util.find_spec("schedulefree") is not None


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike = "zerofit_config.yaml",
                       **kwargs: Any) -> Path | bool:
    """Write a plain zerofit config (DDP, `mixed_precision`) for `zerofit launch --config_file`; returns its
    path, or False when a file is there already (it is never overwritten)."""
    from zerofit.config import save_config
    from zerofit.config.schema import PrecisionConfig, RunConfig

    path = Path(save_location)
    if path.exists():
        return False
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"mixed_precision must be 'no', 'fp16' or 'bf16' (got {mixed_precision!r})")
    save_config(RunConfig(precision=PrecisionConfig(mixed_precision=mixed_precision)), path)
    return path
