"""natsim.kernels: what runs on the GPU. GNA (kernels/gna/) and attention under any block mask
(kernels/sparse/), forward and backward, as PyTorch operators registered in one place (kernels/ops.py), each
with a CPU path through its torch reference; kernels/common/ holds what the families share.
"""

from .common.fp8 import Fp8Scales
from .gna import (
    gna_attention,
    gna_attention_permuted,
    gna_tile_counts,
    permute,
    permute_reference,
    reference_attention,
    unpermute,
    unpermute_reference,
)
from .sparse import (
    SparseMask,
    SparseTileCounts,
    SparseWork,
    prepare_sparse,
    sparse_attention,
    sparse_reference,
    sparse_tile_counts,
)

__all__ = [
    "Fp8Scales",
    "gna_attention",
    "gna_attention_permuted",
    "gna_tile_counts",
    "permute",
    "unpermute",
    "permute_reference",
    "unpermute_reference",
    "reference_attention",
    "SparseMask",
    "SparseTileCounts",
    "SparseWork",
    "prepare_sparse",
    "sparse_attention",
    "sparse_reference",
    "sparse_tile_counts",
]
