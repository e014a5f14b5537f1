"""natsim's Triton kernels as a backend: what they run, and the public face the rooms above the kernels read.

Two `Capabilities` tables, whose values are the kernels' own constants (imported, never copied, so that a table
follows its kernel): `GNA` for the GNA kernels (kernels/gna/) and `MASKS` for the kernels of attention under any
block mask (kernels/sparse/). Both run on CUDA GPUs; on CPU tensors they run only in Triton's interpreter
(TRITON_INTERPRET=1, for tests), which a table does not count as a device. FP8 needs compute capability 8.9 and
GNA's in-place layouts Hopper's tensor descriptors (`has_tensor_descriptors`; older GPUs take the permuted path);
a table holds one capability range for all of a backend's features, so those two are not in it. Both run head_dim
16 to 256 in steps of 8 (kernels/common/headdim.py: widths that are not powers of two in power-of-two column
chunks); FP8 pads head_dim to a power of two and so runs 24 to 256 (`fp8_head_split` refuses 16 with a sentence),
a range the one head-dim list of a table does not hold either.

Beside the tables, what the planner (natsim.planner), the mask predictors (natsim.masks) and context parallelism
(natsim.distributed) need to know about these kernels, under the names they use, so that none of them imports a
kernel module of its own accord:

- GNA's tile catalog: `TILE_TOKENS` (the (Q tokens, KV tokens) pairs worth running per head dim), `tile_pairs`,
  `default_tiles`, `choose_tiles` (with the KV tiling); `kernel_tiles` checks given tiles against the kernel.
- How a GNA call runs: `permutes` (the permuted path), `needs_mask` (the element mask compiled in),
  `dense_as_1d` (dense attention over the flattened layout), `check_qkv` (q, k, v of a layout),
  `copies_layout_rows` and `aligned_width` (in place, the copy into aligned head rows some launches make first).
- GNA's backward: `backward_tiles`, `DEFAULT_VARIANT` (its tuning switches), `DKDV_PRODUCTS` / `DQ_PRODUCTS`
  (tile products per visited pair).
- Block masks: `check_block` (with `MIN_Q_BLOCK` for query blocks), `check_dense_mask`, `check_seq_len`, and
  `default_blocks` (the program tiles the kernel runs a mask's blocks in).
- Both: `check_precision` and `fp8_head_split` (FP8's head dims, with its sentence), `use_triton` /
  `runs_eagerly` (where and how a call runs), `has_tensor_descriptors`.
- For timing only (planner.cost.calibrate): `gna_forward_for_timing`, `gna_backward_for_timing`.
"""

from __future__ import annotations

import torch

from natsim import Problem

from ..common.backend import runs_eagerly, use_triton
from ..common.checks import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from ..common.fp8 import check_precision, fp8_head_split
from ..common.headdim import head_split
from ..common.launch import has_tensor_descriptors
from ..common.rows import aligned_width, copies_layout_rows
from ..gna.backward import DEFAULT_VARIANT, DKDV_PRODUCTS, DQ_PRODUCTS, backward_tiles, gna_backward
from ..gna.checks import MAX_TILE_TOKENS, MIN_TILE_TOKENS, check_qkv, kernel_tiles
from ..gna.dispatch import forward
from ..gna.launch import dense_as_1d, needs_mask, permutes
from ..gna.tiles import TILE_TOKENS, catalog, choose_tiles, default_tiles, tile_pairs
from ..sparse.checks import SPARSE_HEAD_DIMS
from ..sparse.mask import MAX_BLOCK, MIN_BLOCK, check_block, check_dense_mask, check_seq_len
from ..sparse.work import MIN_Q_BLOCK, default_blocks
from .capabilities import Capabilities
from .values import powers_of_two

__all__ = [
    "fp8_head_split",
    "GNA",
    "MASKS",
    "TILE_TOKENS",
    "catalog",
    "tile_pairs",
    "choose_tiles",
    "default_tiles",
    "kernel_tiles",
    "permutes",
    "needs_mask",
    "dense_as_1d",
    "check_qkv",
    "copies_layout_rows",
    "aligned_width",
    "head_split",
    "backward_tiles",
    "DEFAULT_VARIANT",
    "DKDV_PRODUCTS",
    "DQ_PRODUCTS",
    "MIN_Q_BLOCK",
    "check_block",
    "check_dense_mask",
    "check_seq_len",
    "default_blocks",
    "check_precision",
    "use_triton",
    "runs_eagerly",
    "has_tensor_descriptors",
    "gna_forward_for_timing",
    "gna_backward_for_timing",
]

# A GNA tile holds a power-of-two number of tokens in the bounds kernels/gna/checks.py (`kernel_tiles`) accepts;
# the backward's tiles are of the same kind, and KV tiles follow the same rule as Q tiles.
_GNA_TILE_TOKENS = powers_of_two(MIN_TILE_TOKENS, MAX_TILE_TOKENS)

GNA = Capabilities(
    name="Triton GNA",
    devices=("cuda",),
    dtypes=KERNEL_DTYPES,
    head_dims=KERNEL_HEAD_DIMS,
    q_blocks=_GNA_TILE_TOKENS,
    kv_blocks=_GNA_TILE_TOKENS,
    partial_tiles=True,  # the window's element mask inside partial tiles, padding past each dimension's end
    backward=True,
    fp8=True,
    dynamic_kv_tiling=True,  # kernels/gna/dynamic.py
    in_place_layouts=True,  # the layout path reads [B, *shape, H, D] where it lies (Hopper)
    frame_ranges=True,  # frame_offsets, natsim.distributed's halo exchange
)

# A mask's blocks are powers of two up to MAX_BLOCK (kernels/sparse/mask.py); query blocks of at least
# MIN_Q_BLOCK, since a program's member query blocks are bits of an int32 (kernels/sparse/work.py).
MASKS = Capabilities(
    name="Triton block-mask",
    devices=("cuda",),
    dtypes=KERNEL_DTYPES,
    head_dims=SPARSE_HEAD_DIMS,
    q_blocks=powers_of_two(MIN_Q_BLOCK, MAX_BLOCK),
    kv_blocks=powers_of_two(MIN_BLOCK, MAX_BLOCK),
    partial_tiles=True,  # member bits mask a program's tiles; keys past N are masked
    backward=True,
    fp8=True,
    dynamic_kv_tiling=False,
    in_place_layouts=False,  # [B, N, H, D] sequences in the mask's token order
    frame_ranges=False,
)


def gna_forward_for_timing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """GNA's forward of `problem` on `[B, *shape, H, D]` tensors with the kernel's own tiles, and its
    natural-log LSE `[B, *shape, H]`: the dispatch layer straight away, without the operator or autograd.

    For timing (planner.cost.calibrate makes the backward's inputs with it, as a training step has them);
    calls that want gradients use `natsim.kernels.gna_attention`."""
    return forward(q, k, v, problem.window, problem.stride, problem.dilation, problem.causal, return_lse=True)


def gna_backward_for_timing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, grad_out: torch.Tensor,
                            problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of GNA's backward kernels on the backward's own tiles (`backward_tiles`), from the forward's
    output and LSE (`gna_forward_for_timing`): the kernels straight away, without the operator.

    For timing (planner.cost.calibrate times the backward on its own with it); training goes through autograd
    on `natsim.kernels.gna_attention`."""
    return gna_backward(q, k, v, out, lse, grad_out, None, problem)


