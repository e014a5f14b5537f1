"""natsim's Gluon kernel (kernels/gluon/forward.py) as a backend: what it runs.

A warp-specialized forward for Hopper over block-sparse lists of 128 x 128 tiles. In FP8: attention under a block
mask of 128-token blocks in `precision="fp8"`, from bf16 or fp16 inputs it quantizes itself (K's scales shared by
key blocks), and GNA on 128-token tiles, whose partial tiles it masks inside (kernels/gluon/tile_mask.py). Its
16-bit variant runs the same design on bf16 or fp16 inputs as they are, under a block mask
(`sparse_attention`, `gluon_block_attention`). No element mask for block masks, no backward, no PV skip, no
inputs given in float8. `sparse_attention(..., precision="fp8")` and `gna_attention(..., precision="fp8")` take
it wherever a call fits (kernels/gluon/forward.py, `refusal`; GNA left to natsim where every visited block is a
whole tile, or on partial tiles where those pay: kernels/gna/choice.py), natsim's Triton FP8 kernel elsewhere, or
where the call or its prepared work names a backend; a GNA call naming "gluon" runs on it with partial tiles at
any size. A 16-bit `sparse_attention` call naming no backend takes the 16-bit variant at head_dim 128 without
gradients (kernels/sparse/api.py), a call naming "gluon" at 64 too; mask plans for inference pick it by its own
coefficients (natsim.planner.best_mask, `gluon_16bit_coefficients`).

Partial GNA tiles (H200, benchmarks/results/fp8-gluon-partial-*-unsigned-compare.json, quantization and tile
order included): Wan 2.1's 720p layout at window 7x21x35 35.6 ms against 50.6 on the Triton FP8 kernel and 34.1
for natsim's bf16 call; HunyuanVideo's at window 18x24x24 45.3 against 59.7 and 45.5.

Measured on an H100 beside the Triton FP8 kernel and FlashAttention-4's bf16 one, quantization included
(benchmarks/results/fp8-gluon-*.json): dense 32,768 tokens 18.7 ms (Triton FP8 20.4, FlashAttention-4 19.5);
random 128 x 128 masks at 70 % and 90 % sparsity 6.3 and 2.7 ms (8.0 and 3.5; 6.1 and 2.2).

The 16-bit variant on an H200 (benchmarks/results/gluon-16bit-NVIDIA_H200-2026-11-29-split.json, bf16, head_dim
128): random masks at 70 % and 90 % 7.55 and 2.81 ms against natsim's Triton kernel's 9.01 and 3.20 and
FlashAttention-4's 6.38 and 2.33; dense 32,768 tokens 23.9 ms (Triton 23.9, FlashAttention-4 20.3); GNA's partial
tiles (Wan 720p, window 7x21x35) 50.6 ms against natsim's 34.4, so GNA in 16 bits is left to the others.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..common.checks import KERNEL_DTYPES
from ..common.launch import tensor_descriptors_enabled
from ..gluon.forward import BLOCK_M, BLOCK_N, DESCRIPTORS_OFF, HEAD_DIMS
from ..gna.layout import TileLayout
from .capabilities import Capabilities

__all__ = ["MASKS", "GNA", "device_refusal", "permutes_tokens"]

MASKS = Capabilities(
    name="Gluon block-mask",
    devices=("cuda", "cpu"),  # CPU tensors run its torch reference: the FP8 rule's, or float32 attention
    dtypes=KERNEL_DTYPES,
    head_dims=HEAD_DIMS,
    q_blocks=(BLOCK_M,),
    kv_blocks=(BLOCK_N,),
    partial_tiles=False,
    backward=False,
    fp8=True,
    dynamic_kv_tiling=False,
    in_place_layouts=False,
    frame_ranges=False,
    min_capability=(9, 0),
    max_capability=(9, 0),  # wgmma and TMA as Hopper has them
)

# GNA in FP8 (not in 16 bits) on 128-token tiles in the Q tile's token order (partial tiles masked inside), or dense over the
# flattened layout (kernels/gna/choice.py): the same kernel, on the same devices (CPU tensors of a call naming it
# run the rule).
GNA = replace(MASKS, name="Gluon FP8 GNA", partial_tiles=True)


def device_refusal(device: torch.device) -> Optional[str]:
    """None when the Gluon kernel runs on `device` (a Hopper GPU), else one sentence why not (what the
    planner notes before pricing it)."""
    if device.type != "cuda":
        return f"natsim's Gluon kernel runs on Hopper GPUs, and device={str(device)!r} is not a CUDA GPU."
    if not tensor_descriptors_enabled():
        return DESCRIPTORS_OFF
    return GNA.refusal(capability=torch.cuda.get_device_capability(device))


def permutes_tokens(shape: tuple[int, ...], tile: tuple[int, ...]) -> bool:
    """Whether a GNA call on this tile moves q, k, v into the tile's token order and back (a copy each), or the
    order is the layout's own and moving is a reshape (a 1-D tile of a sequence, tiles of whole rows): what the
    planner counts as permutation bytes."""
    return not TileLayout(tuple(shape), tuple(tile), (1,) * len(shape)).row_major
