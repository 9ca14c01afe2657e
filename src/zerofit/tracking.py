"""`zerofit.tracking`: what scripts import from `accelerate.tracking`, under the same names.

A script's own tracker subclasses `GeneralTracker` (or only has its `name`, `store_init_configuration`,
`log` and `finish`) and is passed as an object in `Accelerator(log_with=[...])`; the tracker classes are
what `accelerator.get_tracker(name)` returns. The code lives in `zerofit.frontend.tracking` (`base`,
`selection`, `services`).
"""

from zerofit.frontend.tracking.base import GeneralTracker
from zerofit.frontend.tracking.selection import JsonlTracker, TensorBoardTracker
from zerofit.frontend.tracking.services import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    WandBTracker,
)

__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "JsonlTracker",
           "MLflowTracker", "TensorBoardTracker", "WandBTracker"]
