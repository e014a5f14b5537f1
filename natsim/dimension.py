"""Tile counts along one dimension under multi-D tiling (gna-semantics.md, section 2).

Multi-D Q and KV tiles are Cartesian products of per-dimension ranges, so every multi-D count is a
product of the per-dimension counts computed here. `dim_tiles` counts one configuration tile by tile
(cached: simulations re-use each dimension's counts across the configurations that share them);
`dim_totals_many` gives the totals of many configurations at once, what a sweep needs, and
`dim_unpadded_full_many` the full tiles whose KV tile holds no padding key (what a kernel without a padding mask
may run unmasked).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .window import window_bounds


def ceil_div(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class DimTiles:
    """Per-dimension tile counts, indexed `[dilation group, Q tile within the group]`.

    `visited[g, j]` KV tiles visited by Q tile j of group g (0 for a Q tile holding only padding),
    `full[g, j]` of them full, `kv_first[g, j]` the first visited KV tile's index within the group
    (static KV tiling) and `full_flags[g, j, m]` whether the m-th visited KV tile is full.
    `attended_pairs` counts (query, key) pairs attended along this dimension.
    """

    groups: int
    q_tiles_per_group: int
    kv_tiles_per_group: int
    visited: np.ndarray
    full: np.ndarray
    kv_first: np.ndarray
    full_flags: np.ndarray
    attended_pairs: int


@lru_cache(maxsize=4096)
def dim_tiles(
    length: int,
    window: int,
    stride: int,
    dilation: int,
    causal: bool,
    q_tile: int,
    kv_tile: int,
    dynamic_kv: bool,
) -> DimTiles:
    """Count the KV tiles each Q tile visits along one dimension, for every dilation group."""
    groups = dilation
    nq = ceil_div(length, q_tile * dilation)
    nkv = ceil_div(length, kv_tile * dilation)
    g = np.arange(groups)[:, None]
    group_len = length // dilation + (g < length % dilation).astype(np.int64)  # (d, 1)

    first = np.arange(nq)[None, :] * q_tile  # (1, nq)
    real = first < group_len  # (d, nq): the Q tile holds at least one real query
    first = np.where(real, first, 0)
    last = np.where(real, np.minimum(first + q_tile, group_len) - 1, 0)
    start_first, end_first = window_bounds(first, group_len, window, stride, causal)
    start_last, end_last = window_bounds(last, group_len, window, stride, causal)

    if dynamic_kv:
        visited = ceil_div(end_last - start_first, kv_tile)
        kv_first = np.full_like(visited, -1)
        tile_origin = start_first
    else:
        kv_first = start_first // kv_tile
        visited = ceil_div(end_last, kv_tile) - kv_first
        tile_origin = kv_first * kv_tile
    visited = np.where(real, visited, 0)

    # A visited KV tile is full when every real query of the Q tile sees every real key in it: the
    # window starts are largest at the last query and the ends smallest at the first.
    m = np.arange(max(int(visited.max()), 1))[None, None, :]
    key_start = tile_origin[..., None] + m * kv_tile
    key_end = np.minimum(key_start + kv_tile, group_len[..., None])
    full_flags = (
        (m < visited[..., None])
        & (start_last[..., None] <= key_start)
        & (end_first[..., None] >= key_end)
    )

    return DimTiles(
        groups=groups,
        q_tiles_per_group=nq,
        kv_tiles_per_group=nkv,
        visited=visited.astype(np.int64),
        full=full_flags.sum(axis=-1).astype(np.int64),
        kv_first=kv_first.astype(np.int64),
        full_flags=full_flags,
        attended_pairs=dim_attended_pairs(length, window, stride, dilation, causal),
    )


@lru_cache(maxsize=65536)
def dim_totals(
    length: int,
    window: int,
    stride: int,
    dilation: int,
    causal: bool,
    q_tile: int,
    kv_tile: int,
    dynamic_kv: bool,
) -> tuple[int, int, int]:
    """(visited, full, most) along one dimension: `dim_tiles`' visited and full tiles summed over every Q tile,
    and the most KV tiles one Q tile visits. A sweep multiplies these across dimensions for every
    configuration, so they are kept as plain ints (and cached) instead of being summed again per call."""
    tiles = dim_tiles(length, window, stride, dilation, causal, q_tile, kv_tile, dynamic_kv)
    return int(tiles.visited.sum()), int(tiles.full.sum()), int(tiles.visited.max())


def _full_spans(
    length: int,
    window: int,
    dilation: int,
    causal: bool,
    strides: np.ndarray,
    q_tiles: np.ndarray,
    kv_tiles: np.ndarray,
    dynamic_kv: np.ndarray,
) -> dict[str, np.ndarray]:
    """Every Q tile of every (stride, Q side, KV side, KV tiling) combination along one dimension, flattened:
    `offsets` (where each combination's Q tiles start), and per Q tile its group's length, its first visited KV
    tile (`kv_first`, static KV tiling), its `visited` KV tiles and the first and last of them that are full
    (`lowest`, `highest`, relative to the first visited; none full when `lowest > highest`).

    Its visited tiles start at `origin` every `kv_tile` keys, and tile m is full when it starts at or after the
    last query's window start (m >= ceil((start_last - origin) / kv_tile)) and ends, cut at the group's end, at
    or before the first query's window end (m <= floor((end_first - origin) / kv_tile) - 1, or any m when that
    end is the group's end).
    """
    strides, q_tiles, kv_tiles, dynamic_kv = (np.asarray(a) for a in (strides, q_tiles, kv_tiles, dynamic_kv))
    per_group = ceil_div(length, q_tiles * dilation)  # Q tiles per dilation group, per combination
    counts = per_group * dilation
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    combo = np.repeat(np.arange(len(counts)), counts)  # every (combination, group, Q tile), flattened
    within = np.arange(int(counts.sum())) - offsets[combo]
    group, tile = within // per_group[combo], within % per_group[combo]
    group_len = length // dilation + (group < length % dilation)
    q_tile, kv_tile, stride, dynamic = q_tiles[combo], kv_tiles[combo], strides[combo], dynamic_kv[combo]
    first = tile * q_tile
    real = first < group_len
    first = np.where(real, first, 0)
    last = np.where(real, np.minimum(first + q_tile, group_len) - 1, 0)
    start_first, end_first = window_bounds(first, group_len, window, stride, causal)
    start_last, end_last = window_bounds(last, group_len, window, stride, causal)
    static_first = start_first // kv_tile
    origin = np.where(dynamic, start_first, static_first * kv_tile)
    visited = np.where(dynamic, ceil_div(end_last - start_first, kv_tile), ceil_div(end_last, kv_tile) - static_first)
    visited = np.where(real, visited, 0)
    lowest = np.maximum(ceil_div(start_last - origin, kv_tile), 0)
    highest = np.where(end_first >= group_len, visited - 1,
                       np.minimum((end_first - origin) // kv_tile - 1, visited - 1))
    return dict(offsets=offsets, group_len=group_len, kv_tile=kv_tile, kv_first=static_first, visited=visited,
                lowest=lowest, highest=highest)


def dim_totals_many(
    length: int,
    window: int,
    dilation: int,
    causal: bool,
    strides: np.ndarray,
    q_tiles: np.ndarray,
    kv_tiles: np.ndarray,
    dynamic_kv: np.ndarray,
) -> np.ndarray:
    """`dim_totals` of many (stride, Q side, KV side, KV tiling) combinations along one dimension at once:
    int64 `[combinations, 3]` (visited, full, most). What a sweep asks for every tile configuration.

    The same rule as `dim_tiles` on all Q tiles of all combinations together, with each Q tile's full KV tiles
    counted in closed form instead of flag by flag (`_full_spans`). The tests hold it to `dim_tiles`.
    """
    spans = _full_spans(length, window, dilation, causal, strides, q_tiles, kv_tiles, dynamic_kv)
    offsets, visited = spans["offsets"], spans["visited"]
    full = np.maximum(spans["highest"] - spans["lowest"] + 1, 0)
    return np.stack([np.add.reduceat(visited, offsets), np.add.reduceat(full, offsets),
                     np.maximum.reduceat(visited, offsets)], axis=1).astype(np.int64)


def dim_unpadded_full_many(
    length: int,
    window: int,
    dilation: int,
    causal: bool,
    strides: np.ndarray,
    q_tiles: np.ndarray,
    kv_tiles: np.ndarray,
) -> np.ndarray:
    """Full (Q tile, KV tile) pairs along one dimension whose KV tile holds no padding key, summed over every Q
    tile and dilation group, for many (stride, Q side, KV side) combinations of static KV tiling at once: int64
    `[combinations]`.

    A KV tile holds padding when it runs past its group's end (`(index + 1) * kv_tile > group length`): the
    last tile of a group whose length the tile does not divide. A kernel that runs full tiles without any mask
    (FlashAttention-4's full blocks) must mask those too. Like every multi-D count, the multi-D total is the
    product of these over dimensions: a multi-D KV tile holds padding when it does along some dimension.
    """
    strides = np.asarray(strides)
    spans = _full_spans(length, window, dilation, causal, strides, q_tiles, kv_tiles, np.zeros(len(strides), bool))
    last_unpadded = spans["group_len"] // spans["kv_tile"] - 1 - spans["kv_first"]  # relative to the first visited
    highest = np.minimum(spans["highest"], last_unpadded)
    full = np.maximum(highest - spans["lowest"] + 1, 0)
    return np.add.reduceat(full, spans["offsets"]).astype(np.int64)


def key_ranges(length: int, window: int, stride: int, dilation: int, causal: bool):
    """In-group key ranges `[start, end)` for every coordinate `x` of a dimension (group `x % d`)."""
    x = np.arange(length)
    group = x % dilation
    group_len = length // dilation + (group < length % dilation)
    return window_bounds(x // dilation, group_len, window, stride, causal)


@lru_cache(maxsize=4096)
def dim_attended_pairs(length: int, window: int, stride: int, dilation: int, causal: bool) -> int:
    """(query, key) pairs attended along one dimension, summed over its coordinates."""
    start, end = key_ranges(length, window, stride, dilation, causal)
    return int((end - start).sum())
