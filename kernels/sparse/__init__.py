"""natsim.kernels.sparse: attention under any block mask (FG-Attn), forward and backward: the mask type
(`SparseMask`), its prepared work (`prepare_sparse`: query merging, union lists), the Triton kernels, a call's
spec, the registered operators, the public entry points, and the torch references they are checked against.
"""

from .api import SparseTileCounts, sparse_attention, sparse_tile_counts
from .mask import SparseMask
from .reference import sparse_reference
from .spec import SparseSpec
from .work import SparseWork, prepare_sparse

__all__ = [
    "SparseMask",
    "SparseSpec",
    "SparseTileCounts",
    "SparseWork",
    "prepare_sparse",
    "sparse_attention",
    "sparse_reference",
    "sparse_tile_counts",
]
