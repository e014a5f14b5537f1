"""GNA's element mask as FlashAttention-4's `mask_mod`: kernels/fa4/gna_mask.py's formula traced in CuTe DSL.

FlashAttention-4 calls a `mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)` on the blocks of its
masked list, with Int32 SSA indices; the formula reads only compile-time constants (the layout, window, stride,
dilation, causal flags and tiles), so each geometry compiles its own kernel once. FlashAttention-4 caches
compiled kernels by the mask's `__cute_hash__`, set here from the geometry so that two geometries never share
a kernel.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from typing import Callable

from .gna_mask import Arithmetic, GnaMask


@functools.lru_cache(maxsize=64)
def gna_mask_mod(mask: GnaMask) -> Callable:
    """The CuTe DSL `mask_mod` of `mask` (imports CUTLASS's DSL on first use)."""
    cutlass = importlib.import_module("cutlass")
    cute = importlib.import_module("cutlass.cute")
    utils = importlib.import_module("flash_attn.cute.utils")
    ops = Arithmetic(where=cute.where, const=lambda value: utils.scalar_to_ssa(value, cutlass.Int32))

    @cute.jit
    def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return mask.allowed(q_idx, kv_idx, ops)

    mask_mod.__cute_hash__ = "natsim-gna-" + hashlib.sha256(repr(mask).encode()).hexdigest()
    return mask_mod
