"""natsim.distributed: context parallelism over torch.distributed (`import natsim` does not load it): GNA and
sparse attention on tokens sharded along the layout's first dimension across the ranks of a process group,
moved by Ulysses all-to-alls in groups of heads (pipeline.py) or halo exchanges (strategies.py); natsim.partition is
the simulator's side.
"""

from natsim.partition import STRATEGIES

from .calibrate import calibrate_link
from .collectives import frame_split
from .gna import choose, gna_attention
from .sparse import sparse_attention

__all__ = ["gna_attention", "sparse_attention", "choose", "frame_split", "calibrate_link", "STRATEGIES"]
