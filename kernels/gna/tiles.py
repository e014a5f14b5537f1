"""The tile shapes natsim's GNA kernel runs well, and the default choice among them for one problem.

A kernel tile holds a power-of-two number of tokens (kernels/gna/checks.py says which counts it can run). Which
(Q tokens, KV tokens) pairs it runs *well* is measured knowledge, kept here so that both `gna_attention`'s
defaults and the planner's catalog (natsim.planner.tile_catalog) come from one list. The list is kept per
computed head width (32, 64 and 128 columns, the planner's; one list past them); any other head dim uses the
entry of the width its column chunks compute, rounded up (`catalog`). Tile shapes are boxes
with power-of-two sides no longer than the next power of two of their dimension, since a longer side would
hold only padding. A KV tile is either the Q tile's shape or, for half as many keys, the Q tile halved along
one dimension (NATTEN's 4x8x8 / 2x8x8 pattern).

`choose_tiles` picks, among these and the KV tiling modes it is offered, the tiles with the least predicted
work for the problem: the simulator's exact counts of full and masked tile pairs, weighted by what they cost
this kernel relative to each other; `default_tiles` is its static-only choice, and `fp8_tiles` the FP8 kernel's
(natsim's choice with its Q tile halved).

The relative costs come from the static kernel's calibration. The dynamic kernel (kernels/gna/dynamic.py)
does the same work per box tile on the in-place path (one descriptor load per K/V tile at any corner, the same
two loops), so its simulated counts are weighted the same there; callers offer it only on that path. Its
permuted path gathers every box tile with pointer loads, a cost no calibration has measured yet, so it is
never chosen there unless asked for.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Optional, Sequence

from natsim import Problem, TileConfig, simulate

from ..common.fp8 import fp8_q_tile
from ..common.headdim import HEAD_DIMS, head_split

# (Q tokens, KV tokens) per tile worth running, per head_dim; KV tokens equal the Q tokens or half. 64- and
# 128-token tiles keep the tensor cores busy at these head dims; 256-query tiles spill registers at head_dim 128.
# These are the widths the planner's catalog and cost model cover (natsim.planner).
TILE_TOKENS: dict[int, tuple[tuple[int, int], ...]] = {
    32: ((128, 128), (128, 64), (64, 64)),
    64: ((128, 128), (128, 64), (64, 64)),
    128: ((128, 128), (128, 64), (64, 64)),
}
# The pairs of head dims computed over 128 columns (kernels/common/headdim.py, `WIDE`): at most 64 keys, since
# a 128 x 256 fp32 accumulator alone takes 128 registers a thread at 8 warps and 128-key K/V tiles of 256 columns
# leave room for one pipeline stage; 64-query tiles beside 128-query ones for the register pressure.
WIDE_TILE_TOKENS: tuple[tuple[int, int], ...] = ((128, 64), (64, 64))

# Relative costs of the kernel's work, from its H100 calibration (planner/cost/coefficients/nvidia-h100-80gb-hbm3.json,
# 2026-11-23: 1.78e-15 s per full-tile FLOP, 2.16e-15 s per masked-tile FLOP, 0.12e-15 s more per FLOP in tiles
# of fewer than 128 keys, 0.069 ns per KV tile visit and 31 ns per program, per head), in units of one
# full-tile FLOP. Ratios, not times: they only rank tile shapes.
MASKED_FLOP_COST = 1.22
NARROW_KV_FLOP_COST = 0.07
VISIT_COST = 3.7e4
PROGRAM_COST = 1.75e7
WIDE_TILE = 128

# Tiles for a layout too small for any catalog shape: 128 queries and 128 keys per tile.
FALLBACK_TILES = {1: ((128,), (128,)), 2: ((16, 8), (16, 8)), 3: ((2, 8, 8), (2, 8, 8))}


def box_shapes(tokens: int, limits: Sequence[int]) -> list[tuple[int, ...]]:
    """Every box of `tokens` tokens with power-of-two sides within `limits`, in a fixed order."""
    exponent = tokens.bit_length() - 1
    shapes = []
    for parts in itertools.product(range(exponent + 1), repeat=len(limits)):
        if sum(parts) == exponent:
            shape = tuple(1 << p for p in parts)
            if all(side <= limit for side, limit in zip(shape, limits)):
                shapes.append(shape)
    return shapes


def halves(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """`shape` halved along each dimension that has an even side."""
    return [shape[:i] + (side // 2,) + shape[i + 1 :] for i, side in enumerate(shape) if side > 1]


def catalog(head_dim: int) -> tuple[tuple[int, int], ...]:
    """The (Q tokens, KV tokens) pairs `head_dim` runs: those of the width the kernels compute it in (its column
    chunks, kernels/common/headdim.py: 72 split as 64 + 16 computes 80 columns, padded 128), that width rounded
    up to a key of `TILE_TOKENS` (80 to 128, 16 to 32), or `WIDE_TILE_TOKENS` past the largest key (136 split as
    128 + 16, 256). A head dim natsim's kernels do not run (FlashAttention-4's 8) rounds itself up."""
    width = head_split(head_dim).width if head_dim in HEAD_DIMS else head_dim
    keys = [key for key in TILE_TOKENS if key >= width]  # (no min(..., default=): Dynamo traces this at compile time)
    return TILE_TOKENS[min(keys)] if keys else WIDE_TILE_TOKENS


def tile_pairs(shape: Sequence[int], head_dim: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (Q tile, KV tile) shapes worth running on a token layout `shape` at `head_dim` (may be empty): those of
    its `catalog`."""
    limits = [1 << (length - 1).bit_length() for length in shape]
    pairs = []
    for q_tokens, kv_tokens in catalog(head_dim):
        for q_shape in box_shapes(q_tokens, limits):
            kv_shapes = [q_shape] if kv_tokens == q_tokens else halves(q_shape)
            pairs.extend((q_shape, kv_shape) for kv_shape in kv_shapes)
    return pairs


def relative_cost(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...], head_dim: int,
                  kv_tiling: str = "static") -> float:
    """Predicted work of one head in units of a full-tile FLOP: FLOPs of full and masked tile pairs (padding
    included; those of tiles under 128 keys cost more), KV tile visits and programs, each at its relative cost."""
    result = simulate(problem, TileConfig(q_tile, kv_tile, kv_tiling=kv_tiling))
    pair_flops = 4.0 * head_dim * math.prod(q_tile) * math.prod(kv_tile)
    masked = result.visited_tiles - result.full_tiles
    narrow = NARROW_KV_FLOP_COST * result.visited_tiles if math.prod(kv_tile) < WIDE_TILE else 0.0
    return (pair_flops * (result.full_tiles + MASKED_FLOP_COST * masked + narrow)
            + VISIT_COST * result.visited_tiles + PROGRAM_COST * result.num_q_tiles)


@functools.lru_cache(maxsize=512)
def choose_tiles(problem: Problem, head_dim: int, kv_tilings: tuple[str, ...] = ("static",),
                 q_tile: Optional[tuple[int, ...]] = None, kv_tile: Optional[tuple[int, ...]] = None,
                 ) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """The (Q tile, KV tile, KV tiling) with the least predicted work for `problem` among the catalog's tiles
    (or the given `q_tile` / `kv_tile`) and `kv_tilings`; the first in catalog order, static first, on ties."""
    if q_tile is not None and kv_tile is not None:
        pairs = [(q_tile, kv_tile)]
    else:
        pairs = tile_pairs(problem.shape, head_dim) or [FALLBACK_TILES[problem.ndim]]
    options = [(q, kv, mode) for q, kv in pairs for mode in kv_tilings]
    return min(options, key=lambda option: relative_cost(problem, option[0], option[1], head_dim, option[2]))


def fp8_tiles(problem: Problem, head_dim: int, kv_tilings: tuple[str, ...] = ("static",),
              q_tile: Optional[tuple[int, ...]] = None, kv_tile: Optional[tuple[int, ...]] = None,
              ) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """`choose_tiles` for natsim's Triton FP8 kernel: the given tiles, else natsim's choice with its Q tile halved
    (`fp8_q_tile`)."""
    q_dims, kv_dims, mode = choose_tiles(problem, head_dim, kv_tilings, q_tile, kv_tile)
    return (fp8_q_tile(q_dims) if q_tile is None and kv_tile is None else q_dims), kv_dims, mode


def default_tiles(problem: Problem, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (Q tile, KV tile) with the least predicted work for `problem` under static KV tiling."""
    q_tile, kv_tile, _ = choose_tiles(problem, head_dim)
    return q_tile, kv_tile
