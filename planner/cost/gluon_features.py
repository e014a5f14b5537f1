"""The cost model's features for natsim's Gluon kernel (backend "gluon"): what one of its calls does, in
countable units, in FP8 and in its 16-bit variant alike (each priced by its own coefficients:
`CostModel.gluon_fp8_coefficients`, `gluon_16bit_coefficients`).

The kernel runs 128 x 128 blocks (natsim.kernels.backends.gluon). In FP8: GNA on tokens permuted into a 128-token
tile's order, its partial tiles masked inside by the rows' window bounds, dense attention over the flattened
layout, or a block mask of 128-token blocks; before it, one pass quantizes q, k and v to float8 (reading bf16 /
fp16, writing one byte per element; a GNA layout's q, k, v read in tile order as they are quantized); a GNA layout
permutes the output back. In 16 bits: a block mask of 128-token blocks on q, k, v as they are (nothing moved).

One row per call, one column per feature (batch and heads multiply everything but `launch`):

| feature | unit | what it counts |
|---|---|---|
| `flops` | FLOP | 4 * 128 * 128 * head_dim per visited block |
| `narrow_head_flops` | FLOP | the same again when head_dim is under 128 (their extra cost) |
| `blocks` | block | visited (query block, key block) pairs: the per-iteration overhead |
| `masked_blocks` | block | visited pairs masked inside (GNA's partial tiles, and key tiles holding padding): the mask's per-score work |
| `programs` | tile | query blocks launched: loading Q, the epilogue, storing O |
| `moved_bytes` | byte | FP8: quantizing q, k, v (read, in tile order as they are quantized, and write) and, for GNA whose tile order is not the layout's own, permuting the output back; 16 bits: 0 |
| `launch` | call | 1: launch and host overhead per call |
"""

from __future__ import annotations

import math

import numpy as np

from natsim import Problem, TileConfig, simulate
from natsim.kernels.backends.gluon import permutes_tokens

from .fa4_features import unpadded_full_blocks
from .features import padded_tokens, quantization_bytes, unpermute_bytes

GLUON_FEATURES = ("flops", "narrow_head_flops", "blocks", "masked_blocks", "programs", "moved_bytes", "launch")
GLUON_BLOCK = 128  # tokens of a query block and of a key block
WIDE_HEAD = 128  # channels: smaller head dims pay `narrow_head_flops`


def gluon_feature_matrix(*, visited_blocks, q_padded, batch_heads: int, head_dim: int, element_bytes: int,
                         permute_bytes, masked_blocks=0.0, tokens=None, fp8: bool = True) -> np.ndarray:
    """Features (columns in GLUON_FEATURES order) of calls given as per-row arrays (or scalars): visited blocks
    and those of them masked inside (per batch element and head), the padded sequence length (queries and keys
    alike), the bytes permuted besides the quantization, and the tokens the quantization reads (None: the padded
    length); with `fp8` False, the 16-bit variant's calls, which quantize nothing."""
    visited = np.asarray(visited_blocks, np.float64)
    padded = np.asarray(q_padded, np.float64)
    block_flops = 4.0 * GLUON_BLOCK * GLUON_BLOCK * head_dim * batch_heads
    quantize = 0.0
    if fp8:
        quantize = quantization_bytes(padded if tokens is None else tokens, padded, padded, batch_heads=batch_heads,
                                      head_dim=head_dim, element_bytes=element_bytes)
    columns = [
        visited * block_flops,
        (head_dim < WIDE_HEAD) * visited * block_flops,
        visited * batch_heads,
        np.asarray(masked_blocks, np.float64) * batch_heads,
        padded / GLUON_BLOCK * batch_heads,
        quantize + np.asarray(permute_bytes, np.float64),
        np.ones_like(visited),
    ]
    rows = np.broadcast_shapes(*(np.shape(column) for column in columns))
    out = np.empty((*rows, len(columns)))
    for i, column in enumerate(columns):
        out[..., i] = column
    return out


def gna_gluon_features(problem: Problem, tile: tuple[int, ...], *, batch_heads: int, head_dim: int,
                       element_bytes: int) -> np.ndarray:
    """The feature row of one Gluon GNA call of `problem` on the 128-token `tile` (queries and keys): the
    simulator's visited tiles, those not full or holding padding keys masked, q, k, v quantized as they are read
    in the tile's order, and the output permuted back (where that order is not the layout's own:
    `permutes_tokens`)."""
    visited = simulate(problem, TileConfig(tile, tile)).visited_tiles
    rows = np.array([problem.stride]), np.array([tile]), np.array([tile])
    masked = visited - int(unpadded_full_blocks(problem, *rows)[0])
    padded = padded_tokens(problem.shape, tile, problem.dilation)
    moved = 0.0
    if permutes_tokens(problem.shape, tuple(tile)):
        moved = unpermute_bytes(problem.num_tokens, batch_heads=batch_heads, head_dim=head_dim,
                                element_bytes=element_bytes)
    return gluon_feature_matrix(visited_blocks=visited, q_padded=padded, batch_heads=batch_heads,
                                head_dim=head_dim, element_bytes=element_bytes, permute_bytes=moved,
                                masked_blocks=masked, tokens=problem.num_tokens)


def dense_gluon_features(seq_len: int, *, batch_heads: int, head_dim: int, element_bytes: int) -> np.ndarray:
    """The feature row of dense attention over `seq_len` tokens on the Gluon kernel: every block, nothing
    permuted."""
    blocks = -(-seq_len // GLUON_BLOCK)
    return gluon_feature_matrix(visited_blocks=blocks * blocks, q_padded=blocks * GLUON_BLOCK,
                                batch_heads=batch_heads, head_dim=head_dim, element_bytes=element_bytes,
                                permute_bytes=0.0)


def mask_gluon_features(visited_blocks: float, *, seq_len: int, batch_heads: int, head_dim: int,
                        element_bytes: int, fp8: bool = True) -> np.ndarray:
    """The feature row of one Gluon call under a block mask of 128-token blocks on N = `seq_len`, on
    `batch_heads` sequences that visit `visited_blocks` blocks in all (a mask of batch or heads 1 counts once per
    batch element or head it serves), nothing permuted; in FP8, or with `fp8` False on the 16-bit variant."""
    padded = math.ceil(seq_len / GLUON_BLOCK) * GLUON_BLOCK
    return gluon_feature_matrix(visited_blocks=visited_blocks / batch_heads, q_padded=padded,
                                batch_heads=batch_heads, head_dim=head_dim, element_bytes=element_bytes,
                                permute_bytes=0.0, fp8=fp8)
