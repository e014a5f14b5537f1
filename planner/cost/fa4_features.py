"""The cost model's features for FlashAttention-4 (backend "fa4"): what one of its calls does, in countable units.

FlashAttention-4 runs GNA as a block-sparse call on tokens permuted into the Q tile's order: per query block (a Q
tile) the key blocks (KV tiles) it visits, split into full blocks, run unmasked, and masked blocks, run through
GNA's element mask (`mask_mod`, evaluated element by element: about 8x natsim's masked tiles on an H100). A KV
tile that the simulator calls full but that holds padding keys (a dimension the tile times the dilation does not
divide) is masked there, since an unmasked block would attend its padding rows (`unpadded_full_blocks` counts the
full blocks that are left). Under a block mask every visited block is full and nothing is permuted.

One row per call, one column per feature (batch and heads multiply everything but `launch`):

| feature | unit | what it counts |
|---|---|---|
| `full_flops` | FLOP | 4 * q_block * kv_block * head_dim per visited block run unmasked |
| `masked_flops` | FLOP | the same for visited blocks run through the element mask |
| `narrow_head_flops` | FLOP | every visited block's FLOPs again when head_dim is under 128 (their extra cost) |
| `tiles` | block | visited (query block, key block) pairs: the per-iteration overhead |
| `programs` | tile | query tiles of 128 rows launched: padded query tokens / 128 |
| `permute_bytes` | byte | GNA: q, k, v permuted and the output unpermuted (planner.cost.features' formula); 0 for a block mask |
| `launch` | call | 1: launch and host overhead per call |

The forward and the backward (`CostModel.fa4_coefficients`, `fa4_backward_coefficients`) are priced over the same
features: the backward visits the same blocks, transposed.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from natsim import Problem, TileConfig, simulate
from natsim.dimension import dim_unpadded_full_many

from .features import padded_tokens, permutation_bytes

FA4_FEATURES = ("full_flops", "masked_flops", "narrow_head_flops", "tiles", "programs", "permute_bytes", "launch")
FA4_ROWS = 128  # query rows of one launched tile
WIDE_HEAD = 128  # channels: smaller head dims pay `narrow_head_flops`


def fa4_feature_matrix(
    *,
    full_blocks: np.ndarray,
    visited_blocks: np.ndarray,
    q_block: np.ndarray,
    kv_block: np.ndarray,
    q_padded: np.ndarray,
    batch_heads: int,
    head_dim: int,
    permute_bytes: np.ndarray,
) -> np.ndarray:
    """Features (columns in FA4_FEATURES order) of calls given as per-row arrays (or scalars): full and visited
    blocks (per batch element and head), the blocks' tokens, the padded query length and the bytes permuted."""
    full = np.asarray(full_blocks, np.float64)
    visited = np.asarray(visited_blocks, np.float64)
    block_flops = 4.0 * np.asarray(q_block, np.float64) * np.asarray(kv_block, np.float64) * head_dim * batch_heads
    columns = [
        full * block_flops,
        (visited - full) * block_flops,
        (head_dim < WIDE_HEAD) * visited * block_flops,
        visited * batch_heads,
        np.asarray(q_padded, np.float64) / FA4_ROWS * batch_heads,
        np.asarray(permute_bytes, np.float64),
        np.ones_like(full),
    ]
    rows = np.broadcast_shapes(*(np.shape(column) for column in columns))
    out = np.empty((*rows, len(columns)))
    for i, column in enumerate(columns):
        out[..., i] = column
    return out


@functools.lru_cache(maxsize=4096)
def _per_dimension(length: int, window: int, dilation: int, causal: bool,
                   combinations: tuple[tuple[int, int, int], ...]) -> np.ndarray:
    """`dim_unpadded_full_many` of (stride, Q side, KV side) `combinations` along one dimension, kept: a search
    asks for the same few per window on every call for a layout."""
    strides, q_sides, kv_sides = (np.array(column, np.int64) for column in zip(*combinations))
    values = dim_unpadded_full_many(length, window, dilation, causal, strides, q_sides, kv_sides)
    values.flags.writeable = False
    return values


def unpadded_full_blocks(problem: Problem, strides: np.ndarray, q_tiles: np.ndarray,
                         kv_tiles: np.ndarray) -> np.ndarray:
    """FlashAttention-4's full blocks of `problem` (its window, dilation, causal) at each row's stride and static
    multi-D tiles (`strides`, `q_tiles`, `kv_tiles`: `[rows, ndim]`): the simulator's full (Q tile, KV tile)
    pairs whose KV tile holds no padding key, summed over Q tiles and dilation groups, int64 `[rows]`.

    A multi-D pair is full and unpadded when it is along every dimension, so the total is the product over
    dimensions of the per-dimension totals (natsim.dimension), counted once per distinct (stride, Q side, KV
    side) of a dimension: the rows' values are coded by lookup tables, without sorting the rows."""
    columns = [np.asarray(a, np.int64).reshape(-1, problem.ndim) for a in (strides, q_tiles, kv_tiles)]
    total = np.ones(len(columns[0]), np.int64)
    for axis in range(problem.ndim):
        (strides_d, stride_code), (q_d, q_code), (kv_d, kv_code) = (_codes(column[:, axis]) for column in columns)
        key = (stride_code * len(q_d) + q_code) * len(kv_d) + kv_code
        present = np.zeros(len(strides_d) * len(q_d) * len(kv_d), bool)
        present[key] = True
        keys = np.nonzero(present)[0]
        s_index, rest = np.divmod(keys, len(q_d) * len(kv_d))
        q_index, kv_index = np.divmod(rest, len(kv_d))
        combinations = tuple(zip(strides_d[s_index].tolist(), q_d[q_index].tolist(), kv_d[kv_index].tolist()))
        table = np.zeros(len(present), np.int64)
        table[keys] = _per_dimension(problem.shape[axis], problem.window[axis], problem.dilation[axis],
                                     problem.causal[axis], combinations)
        total *= table[key]
    return total


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of small non-negative ints, ascending, and each value's index among them."""
    present = np.zeros(int(values.max(initial=0)) + 1, bool)
    present[values] = True
    return np.nonzero(present)[0], (np.cumsum(present) - 1)[values]


def gna_fa4_features(problem: Problem, q_tile: Sequence[int], kv_tile: Sequence[int], *, batch_heads: int,
                     head_dim: int, element_bytes: int) -> np.ndarray:
    """The feature row of one FlashAttention-4 GNA call of `problem` with these multi-D tiles (static KV tiling):
    the simulator's visited tiles, its full ones without padding keys, and q, k, v permuted into the Q tile's
    order (FlashAttention-4 reads all three in one order) and the output unpermuted."""
    q_tile, kv_tile = tuple(q_tile), tuple(kv_tile)
    visited = simulate(problem, TileConfig(q_tile, kv_tile)).visited_tiles
    full = unpadded_full_blocks(problem, np.array([problem.stride]), np.array([q_tile]), np.array([kv_tile]))[0]
    q_padded = padded_tokens(problem.shape, q_tile, problem.dilation)
    moved = permutation_bytes(problem.num_tokens, q_padded, q_padded, batch_heads=batch_heads, head_dim=head_dim,
                              element_bytes=element_bytes)
    return fa4_feature_matrix(full_blocks=full, visited_blocks=visited, q_block=math.prod(q_tile),
                              kv_block=math.prod(kv_tile), q_padded=q_padded, batch_heads=batch_heads,
                              head_dim=head_dim, permute_bytes=moved)


def mask_fa4_features(visited_blocks: int, *, q_block: int, kv_block: int, seq_len: int, batch_heads: int,
                      head_dim: int) -> np.ndarray:
    """The feature row of one FlashAttention-4 call under a block mask of `q_block` x `kv_block` tokens on N =
    `seq_len`, on `batch_heads` (batch x heads) sequences that visit `visited_blocks` blocks in all (a mask of
    batch or heads 1 counts once per batch element or head it serves), every one full, nothing permuted."""
    q_padded = -(-seq_len // q_block) * q_block
    return fa4_feature_matrix(full_blocks=visited_blocks / batch_heads, visited_blocks=visited_blocks / batch_heads,
                              q_block=q_block, kv_block=kv_block, q_padded=q_padded, batch_heads=batch_heads,
                              head_dim=head_dim, permute_bytes=0.0)
