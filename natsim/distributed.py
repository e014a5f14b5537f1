"""natsim.distributed: context-parallel GNA and sparse attention over torch.distributed (torch).

The code lives in `kernels/distributed.py` (torch code stays in `natsim.kernels`); this module is its public
name. `import natsim` does not import it, so the simulator keeps running without torch; the simulator's side
of several ranks (per-rank tiles, bytes per strategy) is `natsim.partition`.
"""

from natsim.kernels.distributed import *  # noqa: F401,F403 (the names of its __all__)
from natsim.kernels.distributed import __all__  # noqa: F401
