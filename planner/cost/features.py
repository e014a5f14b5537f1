"""The cost model's features: what a GNA kernel call does, in countable units, from simulated tile counts.

One row per configuration, one column per feature (batch and heads multiply everything but `launch`):

| feature | unit | what it counts |
|---|---|---|
| `full_flops` | FLOP | 4 * T_Q * T_KV * width per visited tile that runs without the window mask (width: head_dim rounded up to a power of two, the width a split head dim runs like) |
| `masked_flops` | FLOP | the same for visited tiles that need the mask (their extra cost is masking) |
| `narrow_q_flops` | FLOP | FLOPs of tiles with fewer than 128 queries (4 warps instead of 8: their extra cost) |
| `narrow_kv_flops` | FLOP | FLOPs of tiles with fewer than 128 keys (more, shorter KV iterations: their extra cost) |
| `narrow_head_flops` | FLOP | FLOPs of calls whose head_dim is under 128 (shorter matrix products: their extra cost) |
| `split_head_flops` | FLOP | FLOPs of launches that run head_dim in two power-of-two chunks (kernels/common/headdim.py: `head_split`): the second chunk's loads and narrow matrix instructions cost beyond the padded width's work (4-9% at 40 and 72 on an H200); launches that pad run like the power of two |
| `kv_tile_visits` | tile | visited (Q tile, KV tile) pairs: the per-iteration overhead of the KV loop |
| `programs` | program | Q tiles launched (padding groups included): loading Q, the epilogue, storing O |
| `permute_bytes` | byte | bytes moved outside the attention kernel: permuting q, k, v and unpermuting the output; in FP8 instead quantizing q, k, v (read in tile order as they are quantized) and unpermuting the output; in place, copying q, k, v into aligned head rows where the launch does (natsim.kernels.common.rows) |
| `launch` | call | 1: launch and host overhead per call |

The features are linear in the work, so predicted time is one dot product per row (planner.cost.model).
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from natsim import SimResult, SweepResult, TileConfig
from natsim.dimension import ceil_div
from natsim.kernels.backends.triton import aligned_width, copies_layout_rows, head_split

FEATURES = (
    "full_flops", "masked_flops", "narrow_q_flops", "narrow_kv_flops", "narrow_head_flops", "split_head_flops",
    "kv_tile_visits", "programs", "permute_bytes", "launch",
)
WIDE_TILE = 128  # tokens: tiles with fewer queries or keys than this pay the narrow-tile features
WIDE_HEAD = 128  # channels: smaller head dims pay `narrow_head_flops`
FP8_BYTES = 1  # bytes of a float8 element


def padded_tokens(shape: Sequence[int], tile: Sequence[int], dilation: Sequence[int]) -> int:
    """Tokens of the permuted layout: every dilation group padded to whole tiles (gna-semantics.md, 2)."""
    return math.prod(d * ceil_div(L, t * d) * t for L, t, d in zip(shape, tile, dilation))


def permutation_bytes(tokens: int, q_padded, kv_padded, *, batch_heads: int, head_dim: int,
                      element_bytes: int) -> np.ndarray:
    """Bytes a call moves permuting q, k, v into tile order (reading the `tokens` real tokens, writing the
    permuted lengths `q_padded` and `kv_padded`, padding included) and unpermuting the output (reading and
    writing real tokens), per row of the length arrays."""
    moved = (tokens + np.asarray(q_padded, np.float64)) + 2.0 * (tokens + np.asarray(kv_padded, np.float64)) \
        + 2.0 * tokens
    return moved * batch_heads * head_dim * element_bytes


def unpermute_bytes(tokens: int, *, batch_heads: int, head_dim: int, element_bytes: int) -> float:
    """Bytes a call moves permuting its output back out of tile order (reading and writing the real tokens)."""
    return 2.0 * tokens * batch_heads * head_dim * element_bytes


def quantization_bytes(tokens: int, q_rows, kv_rows, *, batch_heads: int, head_dim: int,
                       element_bytes: int) -> np.ndarray:
    """Bytes an FP8 call's quantization moves: q, k, v read once in the inputs' dtype (in tile order as they are
    quantized: kernels/gna/permute.py `source_rows`) and written in float8 over the rows the kernel reads,
    `q_rows` for q and `kv_rows` for k and v (padding included)."""
    written = (np.asarray(q_rows, np.float64) + 2.0 * np.asarray(kv_rows, np.float64)) * FP8_BYTES
    return (3.0 * tokens * element_bytes + written) * batch_heads * head_dim


def feature_matrix(
    *,
    full_tiles: np.ndarray,
    visited_tiles: np.ndarray,
    q_tokens: np.ndarray,
    kv_tokens: np.ndarray,
    q_padded: np.ndarray,
    kv_padded: np.ndarray,
    tokens: int,
    batch_heads: int,
    head_dim: int,
    element_bytes: int,
    permutation: bool = True,
    quantized: bool = False,
    copied_rows: Union[bool, np.ndarray] = False,
    split_heads: Union[bool, np.ndarray] = False,
) -> np.ndarray:
    """Features (columns in FEATURES order) of configurations given as per-row arrays.

    `q_padded` / `kv_padded` are the permuted lengths of the q and k/v layouts (padding included) and
    `tokens` the real token count; `permutation=False` leaves out the permutation's bytes (a dense
    baseline that needs none). `quantized` (FP8) counts the quantization pass's bytes instead of the permuted
    copies (`quantization_bytes`), and the output's permutation back where the call permutes. `copied_rows` (per row or
    for all) adds the copy of q, k, v into aligned head rows (`copies_rows_of`); `split_heads` (per row or for all)
    marks launches that run head_dim in two chunks (`splits_heads_of`).
    """
    full = np.asarray(full_tiles, np.float64)
    visited = np.asarray(visited_tiles, np.float64)
    q_tokens = np.asarray(q_tokens, np.float64)
    kv_tokens = np.asarray(kv_tokens, np.float64)
    q_padded = np.asarray(q_padded, np.float64)
    kv_padded = np.asarray(kv_padded, np.float64)
    # Work is counted at head_dim rounded up to a power of two. A width the kernel computes in two power-of-two
    # chunks (72 as 64 + 16) runs within about 10% of its time padded to that power of two (docs/performance.md,
    # "Head dims that are not powers of two"): the second chunk's narrow products do not shorten a loop bound by
    # the first chunk's loads and the softmax. Counting only the chunks' columns priced 72 at 0.62-0.76 of 128.
    width = 1 << (head_dim - 1).bit_length()
    tile_flops = 4.0 * q_tokens * kv_tokens * width * batch_heads
    call = dict(batch_heads=batch_heads, head_dim=head_dim, element_bytes=element_bytes)
    permute_bytes = np.zeros_like(q_padded)
    if quantized:  # no permuted copies: the quantization reads in tile order; the output goes back
        q_rows, kv_rows = (q_padded, kv_padded) if permutation else (tokens, tokens)
        permute_bytes = permute_bytes + quantization_bytes(tokens, q_rows, kv_rows, **call)
        if permutation:
            permute_bytes = permute_bytes + unpermute_bytes(tokens, **call)
    elif permutation:
        permute_bytes = permute_bytes + permutation_bytes(tokens, q_padded, kv_padded, **call)
    copy = 3.0 * tokens * batch_heads * (head_dim + aligned_width(head_dim, element_bytes)) * element_bytes
    permute_bytes = permute_bytes + np.asarray(copied_rows, np.float64) * copy  # read at head_dim, written aligned
    columns = [
        full * tile_flops,
        (visited - full) * tile_flops,
        (q_tokens < WIDE_TILE) * visited * tile_flops,
        (kv_tokens < WIDE_TILE) * visited * tile_flops,
        (width < WIDE_HEAD) * visited * tile_flops,
        np.asarray(split_heads, np.float64) * visited * tile_flops,
        visited * batch_heads,
        q_padded / q_tokens * batch_heads,
        permute_bytes,
        np.ones_like(full),
    ]
    rows = np.broadcast_shapes(*(np.shape(column) for column in columns))
    out = np.empty((*rows, len(columns)))  # filled column by column: the same values as stacking, without copies
    for i, column in enumerate(columns):
        out[..., i] = column
    return out


def features_of(
    result: SimResult, *, batch_heads: int, head_dim: int, element_bytes: int, permutation: bool = True,
    quantized: bool = False,
) -> np.ndarray:
    """The feature row of one simulated configuration (multi-D tiling), the row copy into aligned head rows
    included where its launch makes one (as `sweep_features` counts it)."""
    problem, tiles = result.problem, result.tiles
    q_tile, kv_tile = tiles.dims(problem)
    return feature_matrix(
        full_tiles=np.array([result.full_tiles]),
        visited_tiles=np.array([result.visited_tiles]),
        q_tokens=np.array([tiles.q_tokens]),
        kv_tokens=np.array([tiles.kv_tokens]),
        q_padded=np.array([padded_tokens(problem.shape, q_tile, problem.dilation)]),
        kv_padded=np.array([padded_tokens(problem.shape, kv_tile, problem.dilation)]),
        tokens=problem.num_tokens,
        batch_heads=batch_heads,
        head_dim=head_dim,
        element_bytes=element_bytes,
        permutation=permutation,
        quantized=quantized,
        copied_rows=copies_rows_of([tiles], head_dim=head_dim, element_bytes=element_bytes, permutation=permutation,
                                   quantized=quantized),
        split_heads=splits_heads_of([tiles], head_dim=head_dim, quantized=quantized),
    )[0]


def copies_rows_of(tiles: Sequence[TileConfig], *, head_dim: int, element_bytes: int, permutation: bool,
                   quantized: bool = False) -> np.ndarray:
    """Per tile configuration, whether natsim's GNA forward copies a model's contiguous q, k, v into aligned head
    rows before its launch (natsim.kernels.common.rows): in place (no permutation), not in FP8, on the launches
    and row alignments that copy."""
    return np.array([not (permutation or quantized)
                     and copies_layout_rows((t.kv_tiling, t.q_tokens), head_dim, element_bytes) for t in tiles], bool)


def splits_heads_of(tiles: Sequence[TileConfig], *, head_dim: int, quantized: bool = False) -> np.ndarray:
    """Per tile configuration, whether natsim's GNA forward launch runs `head_dim` in two power-of-two chunks
    (`head_split`'s default for the launch `(kv_tiling, query tile tokens)`); FP8 pads every width."""
    return np.array([not quantized and head_split(head_dim, launch=(t.kv_tiling, t.q_tokens)).b > 0 for t in tiles],
                    bool)


def sweep_features(
    result: SweepResult, *, batch_heads: int, head_dim: int, element_bytes: int, permutation: bool = True,
    quantized: bool = False,
) -> np.ndarray:
    """The feature rows of every configuration of a sweep (multi-D tiling), row i for `result.result(i)`."""
    problem = result.problem
    dims = [tiles.dims(problem) for tiles in result.tiles]
    per_tile = {
        "q_tokens": np.array([t.q_tokens for t in result.tiles], np.int64),
        "kv_tokens": np.array([t.kv_tokens for t in result.tiles], np.int64),
        "q_padded": np.array([padded_tokens(problem.shape, q, problem.dilation) for q, _ in dims], np.int64),
        "kv_padded": np.array([padded_tokens(problem.shape, kv, problem.dilation) for _, kv in dims], np.int64),
    }
    index = result.tile_index
    return feature_matrix(
        full_tiles=result.full_tiles,
        visited_tiles=result.visited_tiles,
        **{name: column[index] for name, column in per_tile.items()},
        tokens=problem.num_tokens,
        batch_heads=batch_heads,
        head_dim=head_dim,
        element_bytes=element_bytes,
        permutation=permutation,
        quantized=quantized,
        copied_rows=copies_rows_of(result.tiles, head_dim=head_dim, element_bytes=element_bytes,
                                   permutation=permutation, quantized=quantized)[index],
        split_heads=splits_heads_of(result.tiles, head_dim=head_dim, quantized=quantized)[index],
    )


def tile_arrays(shape: Sequence[int], tiles: Sequence[TileConfig]) -> dict[str, np.ndarray]:
    """Per tile configuration: tokens per Q and KV tile and padded q / k-v lengths (dilation 1)."""
    ones = (1,) * len(shape)
    return {
        "q_tokens": np.array([t.q_tokens for t in tiles], np.int64),
        "kv_tokens": np.array([t.kv_tokens for t in tiles], np.int64),
        "q_padded": np.array([padded_tokens(shape, t.q_tile, ones) for t in tiles], np.int64),
        "kv_padded": np.array([padded_tokens(shape, t.kv_tile, ones) for t in tiles], np.int64),
    }
