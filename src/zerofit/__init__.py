"""zerofit: ZeRO sharding and offload for PyTorch training, driven by the config files you already have.

    from zerofit import Accelerator          # the Accelerate API over zerofit's engine
    from zerofit.utils import DummyOptim, DummyScheduler, set_seed

The front end is imported on first use, so `zerofit` commands that only read configs start fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Accelerate's top-level names (and zerofit's placeholders), imported on first use.
_LAZY = {
    "Accelerator": "zerofit.frontend.accelerator",
    "DistributedType": "zerofit.frontend.state",
    "PartialState": "zerofit.frontend.processes",
    "declare_optimizer": "zerofit.engine.optimizer_kinds",
    **{name: "zerofit.frontend.utils" for name in (
        "DummyOptim", "DummyScheduler", "ProjectConfiguration", "find_executable_batch_size",
        "init_empty_weights", "init_on_device")},
    **{name: "zerofit.frontend.plugins" for name in (
        "AutocastKwargs", "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
        "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs",
        "ProfileKwargs")},
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
