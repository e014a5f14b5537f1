"""natsim: simulate, plan and run multi-dimensional sparse attention (Generalized Neighborhood Attention).
This package is the model of the problem and its simulator (parameters, tiles, tile counts, block masks, query
merging, sweeps): numpy only, numba on first use; the rooms natsim.kernels, masks, distributed, planner use torch.
"""

from .backward import BackwardSim, simulate_backward
from .blockmask import BlockMask, block_mask
from .estimate import end_to_end_speedup
from .problem import Problem
from .simulate import SimResult, simulate
from .sweep import SweepResult, default_tile_catalog, sweep
from .tiles import TileConfig

__all__ = [
    "Problem",
    "TileConfig",
    "SimResult",
    "simulate",
    "BackwardSim",
    "simulate_backward",
    "BlockMask",
    "block_mask",
    "SweepResult",
    "sweep",
    "default_tile_catalog",
    "end_to_end_speedup",
    "merge",
    "MergeResult",
]
__version__ = "0.1.0"



def __getattr__(name: str):
    # Query-tile merging compiles with numba: natsim.merging is imported on first use, keeping
    # `import natsim` fast.
    if name in ("merge", "MergeResult"):
        from . import merging

        return getattr(merging, name)
    raise AttributeError(f"module 'natsim' has no attribute {name!r}")
