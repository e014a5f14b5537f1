"""natsim.masks: content-adaptive block masks for `natsim.kernels.sparse_attention` (torch; `import natsim` does
not load it): predictors from q and k (predictors.py), their reuse across diffusion steps (cache.py), Hilbert
token orders (hilbert.py), and the algebra that keeps GNA's window and global tokens (algebra.py, gna.py).
"""

from .algebra import intersection, keep_global, union
from .cache import MaskCache
from .gna import gna_block_mask
from .hilbert import from_order, hilbert_inverse, hilbert_order, to_order
from .predictors import hierarchical, sparge, topp

__all__ = [
    "hilbert_order",
    "hilbert_inverse",
    "to_order",
    "from_order",
    "topp",
    "sparge",
    "hierarchical",
    "MaskCache",
    "union",
    "intersection",
    "keep_global",
    "gna_block_mask",
]
