"""natsim: simulate, plan and run multi-dimensional sparse attention (Generalized Neighborhood Attention)."""

from .blockmask import BlockMask, block_mask
from .problem import Problem
from .simulate import SimResult, simulate
from .tiles import TileConfig

__all__ = ["Problem", "TileConfig", "SimResult", "simulate", "BlockMask", "block_mask"]
__version__ = "0.1.0"
