"""What scripts import from `accelerate.utils`, under the same names: seeds, placeholders, small helpers.

`DummyOptim` and `DummyScheduler` stand for the optimizer and schedule the config names; `prepare()`
replaces them (see `zerofit.frontend.accelerator`). The signatures match Accelerate's, so scripts only change
the import.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerofit.frontend.ops import (
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from zerofit.frontend.state import DistributedType

__all__ = [
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "ProjectConfiguration",
    "broadcast_object",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
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
