"""zerofit: ZeRO sharding and offload for PyTorch training, driven by the config files you already have.

    from zerofit import Accelerator          # the Accelerate API over zerofit's engine
    from zerofit.utils import DummyOptim, DummyScheduler, set_seed

The front end is imported on first use, so `zerofit` commands that only read configs start fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Accelerator": "zerofit.frontend.accelerator",
    "DistributedType": "zerofit.frontend.state",
    "DummyOptim": "zerofit.frontend.utils",
    "DummyScheduler": "zerofit.frontend.utils",
}

__all__ = ["Accelerator", "DistributedType", "DummyOptim", "DummyScheduler", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
