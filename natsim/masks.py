"""natsim.masks: content-adaptive block masks for `natsim.kernels.sparse_attention` (torch).

The code lives in `kernels/masks.py` (torch code stays in `natsim.kernels`); this module is its public
name. `import natsim` does not import it, so the simulator keeps running without torch: import
`natsim.masks` where masks are built.
"""

from natsim.kernels.masks import (
    from_order,
    gna_block_mask,
    hilbert_inverse,
    hilbert_order,
    intersection,
    keep_global,
    to_order,
    topp,
    union,
)

__all__ = [
    "hilbert_order",
    "hilbert_inverse",
    "to_order",
    "from_order",
    "topp",
    "union",
    "intersection",
    "keep_global",
    "gna_block_mask",
]
