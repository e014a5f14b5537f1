"""FlashAttention-4 (`flash-attn-4`, CuTe-DSL kernels) as a backend: what it runs, and the face the rooms above
read.

natsim runs FlashAttention-4's Hopper forward and backward with block sparsity (kernels/fa4/): a GNA call on
tokens in tile order (the simulator's full tiles as its full blocks, partial tiles through a `mask_mod` that
evaluates GNA's window), and attention under a block mask of block sizes it runs. The tables hold what any call
of a family may use; `tile_refusal` holds the rules that tie block sizes to the head dim, read off
FlashAttention-4 4.0.0b36's Hopper tile configurations:

- forward: a query block is a multiple of 64 tokens (the kernel's query tile shrinks from 128 or 192 to 64 to
  divide it); a key block is a multiple of 16 up to the kernel's key tile, 128 tokens for head dims to 192 and
  80 at 256 (a smaller block shrinks the tile to it);
- backward: a key block equals the backward's key tile (128 tokens for head dims to 128; natsim's power-of-two
  blocks fit no other), and a query block is a multiple of its query tile (128 tokens for head dims to 64, else
  64); not at head dims 8, 16, 40, 48, 72, 80, 104 and 112, where its dQ comes back wrong (the kernel pads the
  head dim to a multiple of 16, the dQ accumulator to 32; checked on the GPU by tests/test_fa4_gpu.py);
- GNA: q, k and v are read in one token order, the Q tile's, so a KV tile must form contiguous runs of it: the Q
  tile itself, or a slab of it along its first dimension longer than 1 (`gna_tile_refusal`).

Measured on an H100 (benchmarks/results/fa4-probe-*.json): full blocks run faster than natsim's Triton kernels
(dense 18.7 vs 23.0 ms at 32,768 tokens; HunyuanVideo's block-sparse 16x8x8 23.3 vs 28 ms); blocks through the
GNA `mask_mod` run about 8x slower than natsim's masked tiles, since the mask is evaluated element by element.
"""

from __future__ import annotations

from ..common.checks import KERNEL_DTYPES
from ..fa4.library import installed
from ..fa4.rules import HEAD_DIMS, device_refusal, gna_tile_refusal, tile_refusal
from .capabilities import Capabilities

__all__ = ["GNA", "MASKS", "installed", "device_refusal", "tile_refusal", "gna_tile_refusal", "HEAD_DIMS",
           "MAX_GNA_Q_BLOCK"]

MAX_GNA_Q_BLOCK = 256  # natsim's largest GNA tile (kernels/gna/checks.py)
_KV_BLOCKS = tuple(range(16, 129, 16))

GNA = Capabilities(
    name="FlashAttention-4 GNA",
    devices=("cuda",),
    dtypes=KERNEL_DTYPES,
    head_dims=HEAD_DIMS,
    q_blocks=tuple(range(64, MAX_GNA_Q_BLOCK + 1, 64)),
    kv_blocks=_KV_BLOCKS,
    partial_tiles=True,  # through the GNA mask_mod (slow: see the module docstring)
    backward=True,
    fp8=False,  # FlashAttention-4's FP8 runs on Blackwell only
    dynamic_kv_tiling=False,  # its key blocks lie on a fixed grid
    in_place_layouts=False,  # tokens in tile order: natsim permutes them for it
    frame_ranges=False,
    min_capability=(9, 0),
    max_capability=(9, 0),  # natsim has checked FlashAttention-4's Hopper kernels only
)

MASKS = Capabilities(
    name="FlashAttention-4 block-mask",
    devices=("cuda",),
    dtypes=KERNEL_DTYPES,
    head_dims=HEAD_DIMS,
    q_blocks=(64, 128),  # natsim's query blocks are powers of two up to 128
    kv_blocks=(16, 32, 64, 128),
    partial_tiles=False,  # a block mask's blocks are whole: every visited block is full
    backward=True,
    fp8=False,
    dynamic_kv_tiling=False,
    in_place_layouts=False,
    frame_ranges=False,
    min_capability=(9, 0),
    max_capability=(9, 0),
)
