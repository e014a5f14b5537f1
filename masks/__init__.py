"""natsim.masks: content-adaptive block masks for `natsim.kernels.sparse_attention` (torch; `import natsim` does
not import it). Predictors from q and k, their reuse across diffusion steps, token orders that make masks
sparse, and the algebra that combines masks with GNA's window and global tokens.

- `hilbert_order` / `hilbert_inverse`, `to_order` / `from_order` (masks/hilbert.py): a Hilbert-curve token
  order for 2-D and 3-D layouts of any size, so that the tokens of one block are near each other in the
  layout and a block mask can be sparse (DFSAttn, SpargeAttn). The order is numpy only.
- `topp`, `sparge`, `hierarchical` (masks/predictors.py): FG-Attn's, SpargeAttn's and DFSAttn's mask
  predictors from q and k, torch ops only, so they run where q and k are.
- `MaskCache` (masks/cache.py): DFSAttn's reuse of masks across diffusion steps, with dense warm-up
  steps and its shrinking budget (Algorithm 1).
- `union`, `intersection`, `keep_global` (masks/algebra.py), `gna_block_mask` (masks/gna.py): combining masks, always-kept global rows and
  columns (text tokens, the first frame) and natsim's GNA window as a block mask, so that local attention is
  kept whatever a predictor says.

Every mask here is the boolean `[B or 1, H or 1, ceil(N / q_block), ceil(N / kv_block)]` tensor that
`natsim.kernels.sparse_attention` and `SparseMask.from_dense` take: True where a query block attends a key
block.
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
