"""`zerofit.local_sgd.LocalSGD`: Accelerate's local SGD, spelled as scripts import it (`accelerate.local_sgd`).

The code lives in `zerofit.frontend.local_sgd`.
"""

from zerofit.frontend.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
