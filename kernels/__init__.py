"""natsim.kernels: Triton kernels for GNA (static and dynamic KV tiling, frame ranges) and for any block mask,
forward and backward, token permutation, the registered operators they run as (kernels/ops.py: autograd goes
through them), and their torch references. Context parallelism is natsim.distributed (kernels/distributed.py);
mask predictors are natsim.masks (kernels/masks.py, predictors.py, maskcache.py)."""

from .attention import gna_attention, gna_attention_permuted, gna_tile_counts
from .permute import permute, permute_reference, unpermute, unpermute_reference
from .reference import reference_attention

__all__ = [
    "gna_attention",
    "gna_attention_permuted",
    "gna_tile_counts",
    "permute",
    "unpermute",
    "permute_reference",
    "unpermute_reference",
    "reference_attention",
]

from .sparse import (  # noqa: E402  (issue 9: attention under any block mask)
    SparseTileCounts,
    SparseWork,
    prepare_sparse,
    sparse_attention,
    sparse_reference,
    sparse_tile_counts,
)
from .sparsemask import SparseMask  # noqa: E402

__all__ += [
    "SparseMask",
    "SparseTileCounts",
    "SparseWork",
    "prepare_sparse",
    "sparse_attention",
    "sparse_reference",
    "sparse_tile_counts",
]
