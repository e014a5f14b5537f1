"""The torch references as a backend: what kernels/gna/reference.py and kernels/sparse/reference.py run as the CPU
path of every call (the dispatchers and the families' operators, kernels/gna/ops.py and kernels/sparse/ops.py,
send CPU tensors there when Triton's interpreter is off).

The references are exact attention in float32 (float64 for float64 inputs) under the element mask: they take
any floating dtype and any head dim, a backward pass (autograd through torch ops), FP8 calls (FP8's
quantization rule emulated in float32, kernels/common/fp8.py; no FP8 tensor cores) and, for GNA, frame ranges.
The GNA reference has no tiles: calls naming any Q or KV tile or KV tiling mode run it exactly, on the layout
where it lies. The block-mask reference checks a mask's blocks as the kernel does (kernels/sparse/work.py's
`dense_mask`), on `[B, N, H, D]` sequences in the mask's token order. They also run on CUDA tensors, but natsim
sends those to the Triton kernels, so a table says CPU.

A table lists its values, and "any" is not a list: head dims (and the GNA reference's tile tokens) are listed
from 1 to LISTED_UP_TO, past any attention head or tile natsim meets.
"""

from __future__ import annotations

import torch

from ..sparse.mask import MAX_BLOCK, MIN_BLOCK
from ..sparse.work import MIN_Q_BLOCK
from .capabilities import Capabilities
from .values import powers_of_two

LISTED_UP_TO = 1024
_ANY = tuple(range(1, LISTED_UP_TO + 1))
# Every floating dtype the references compute from (float8 inputs are FP8 calls, with their scales).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

GNA = Capabilities(
    name="torch reference GNA",
    devices=("cpu",),
    dtypes=_DTYPES,
    head_dims=_ANY,
    q_blocks=_ANY,
    kv_blocks=_ANY,
    partial_tiles=True,
    backward=True,
    fp8=True,
    dynamic_kv_tiling=True,
    in_place_layouts=True,
    frame_ranges=True,
)

MASKS = Capabilities(
    name="torch reference block-mask",
    devices=("cpu",),
    dtypes=_DTYPES,
    head_dims=_ANY,
    q_blocks=powers_of_two(MIN_Q_BLOCK, MAX_BLOCK),
    kv_blocks=powers_of_two(MIN_BLOCK, MAX_BLOCK),
    partial_tiles=True,
    backward=True,
    fp8=True,
    dynamic_kv_tiling=False,
    in_place_layouts=False,
    frame_ranges=False,
)
