"""natsim.kernels.gna: Generalized Neighborhood Attention on the GPU, forward (static and dynamic KV tiling,
frame ranges) and backward, with the token permutation, tile choice and launch that feed the kernels, the
public entry points, a call's spec, the registered operators, and the torch reference they are checked against.
"""

from .api import chosen_backend, gna_attention, gna_attention_permuted, gna_tile_counts
from .permute import permute, permute_reference, unpermute, unpermute_reference
from .reference import reference_attention
from .spec import FrameRange, GnaSpec

__all__ = [
    "chosen_backend",
    "FrameRange",
    "GnaSpec",
    "gna_attention",
    "gna_attention_permuted",
    "gna_tile_counts",
    "permute",
    "unpermute",
    "permute_reference",
    "unpermute_reference",
    "reference_attention",
]
