"""`zerofit.utils`: what scripts import from `accelerate.utils`, under the same names, and zerofit's own
helpers for loading pretrained models too big for one copy per rank (`load_at_prepare`,
`empty_from_pretrained`).

Scripts keep writing `from zerofit.utils import set_seed, DummyOptim`; the code lives in
`zerofit.frontend.utils` (and the collectives on nested data in `zerofit.frontend.ops`, the loading
helpers in `zerofit.frontend.pretrained`).
"""

from zerofit.frontend.pretrained import empty_from_pretrained, load_at_prepare
from zerofit.frontend.utils import *  # noqa: F401,F403 - this module is the public spelling of those names
from zerofit.frontend.utils import __all__ as _accelerate_names

__all__ = [*_accelerate_names, "empty_from_pretrained", "load_at_prepare"]
