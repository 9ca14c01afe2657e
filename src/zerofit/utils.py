"""`zerofit.utils`: what scripts import from `accelerate.utils`, under the same names.

Scripts keep writing `from zerofit.utils import set_seed, DummyOptim`; the code lives in
`zerofit.frontend.utils` (and the collectives on nested data in `zerofit.frontend.ops`).
"""

from zerofit.frontend.utils import *  # noqa: F401,F403 - this module is the public spelling of those names
from zerofit.frontend.utils import __all__  # noqa: F401
