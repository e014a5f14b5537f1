"""natsim.masks: content-adaptive block masks for `natsim.kernels.sparse_attention` (torch).

The code lives in `kernels/masks.py` (torch code stays in `natsim.kernels`); this module is its public
name. `import natsim` does not import it, so the simulator keeps running without torch: import
`natsim.masks` where masks are built.
"""

from natsim.kernels.masks import *  # noqa: F401,F403 (the names of its __all__)
from natsim.kernels.masks import __all__  # noqa: F401
