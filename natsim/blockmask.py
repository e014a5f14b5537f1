"""Block masks: the visited (Q tile, KV tile) pairs as plain index arrays, in FlexAttention's layout.

As in `torch.nn.attention.flex_attention.BlockMask`, visited KV tiles are split in two:

- `kv_num_blocks[q]`, `kv_indices[q, :kv_num_blocks[q]]`: partial tiles, which need the element mask;
- `full_kv_num_blocks[q]`, `full_kv_indices[q, :full_kv_num_blocks[q]]`: full tiles, which run unmasked.

Indices are ascending within a row; entries past a row's count are 0 and carry no meaning. Rows are
only as wide as the busiest Q tile, so memory grows with the visited tiles, never with N^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import Problem
from .simulate import _dense_tile_counts, per_dimension
from .tiles import TileConfig


@dataclass(frozen=True)
class BlockMask:
    """Visited tiles per Q tile (see the module docstring for the layout).

    `num_q_tiles` / `num_kv_tiles` are the sizes of the tile grids the indices refer to. Under multi-D
    tiling with dilation these count the tiles of every dilation group, numbered groups first.
    """

    num_q_tiles: int
    num_kv_tiles: int
    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray

    @property
    def visited(self) -> np.ndarray:
        """KV tiles visited by each Q tile (partial + full)."""
        return self.kv_num_blocks.astype(np.int64) + self.full_kv_num_blocks

    @property
    def density(self) -> float:
        """Visited pairs over all (Q tile, KV tile) pairs."""
        return float(self.visited.sum()) / (self.num_q_tiles * self.num_kv_tiles)

    def to_dense(self) -> np.ndarray:
        """A boolean `[num_q_tiles, num_kv_tiles]` array of visited pairs (for small masks)."""
        dense = np.zeros((self.num_q_tiles, self.num_kv_tiles), dtype=bool)
        for counts, indices in (
            (self.kv_num_blocks, self.kv_indices),
            (self.full_kv_num_blocks, self.full_kv_indices),
        ):
            rows, cols = _valid_entries(counts, indices)
            dense[rows, cols] = True
        return dense

    def full_dense(self) -> np.ndarray:
        """A boolean `[num_q_tiles, num_kv_tiles]` array of full pairs (for small masks)."""
        dense = np.zeros((self.num_q_tiles, self.num_kv_tiles), dtype=bool)
        rows, cols = _valid_entries(self.full_kv_num_blocks, self.full_kv_indices)
        dense[rows, cols] = True
        return dense

    @classmethod
    def from_dense(cls, mask: np.ndarray) -> "BlockMask":
        """A block mask from a boolean `[num_q_tiles, num_kv_tiles]` array; every tile is partial."""
        mask = np.asarray(mask)
        if mask.ndim != 2 or mask.dtype != bool:
            raise ValueError(
                f"mask must be a 2-D boolean array [num_q_tiles, num_kv_tiles], got "
                f"ndim={mask.ndim}, dtype={mask.dtype}."
            )
        counts, indices = _compact(mask, np.broadcast_to(np.arange(mask.shape[1]), mask.shape))
        empty_counts = np.zeros(mask.shape[0], np.int32)
        empty_indices = np.zeros((mask.shape[0], 1), np.int32)
        return cls(mask.shape[0], mask.shape[1], counts, indices, empty_counts, empty_indices)


def _valid_entries(counts: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    valid = np.arange(indices.shape[1])[None, :] < counts[:, None]
    rows = np.nonzero(valid)[0]
    return rows, indices[valid]


def _compact(keep: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Move the kept entries of each row to its front (order preserved); pad rows with 0."""
    counts = keep.sum(axis=1).astype(np.int32)
    width = max(int(counts.max(initial=0)), 1)
    order = np.argsort(~keep, axis=1, kind="stable")[:, :width]
    picked = np.take_along_axis(index, order, axis=1)
    valid = np.arange(width)[None, :] < counts[:, None]
    return counts, np.where(valid, picked, 0).astype(np.int32)


def _multi_d(problem: Problem, tiles: TileConfig) -> BlockMask:
    dims = per_dimension(problem, tiles)
    n = len(dims)
    q_grid = [d.groups for d in dims] + [d.q_tiles_per_group for d in dims]
    coords = np.indices(q_grid).reshape(2 * n, -1)  # per Q tile: groups g_i, then tiles t_i
    num_q = coords.shape[1]
    kv_per_group = [d.kv_tiles_per_group for d in dims]
    kv_strides = [math.prod(kv_per_group[i + 1 :]) for i in range(n)]
    group_index = np.ravel_multi_index(tuple(coords[:n]), [d.groups for d in dims])

    linear = (group_index * math.prod(kv_per_group)).reshape((num_q,) + (1,) * n)
    valid = np.ones((num_q,) + (1,) * n, dtype=bool)
    full = np.ones((num_q,) + (1,) * n, dtype=bool)
    for i, d in enumerate(dims):
        g, t = coords[i], coords[n + i]
        m = np.arange(d.full_flags.shape[-1])
        axis_shape = [1] * n
        axis_shape[i] = -1
        expand = lambda a: a.reshape((num_q,) + tuple(axis_shape))  # noqa: E731
        linear = linear + expand((d.kv_first[g, t][:, None] + m) * kv_strides[i])
        valid = valid & expand(m[None, :] < d.visited[g, t][:, None])
        full = full & expand(d.full_flags[g, t])
    shape = np.broadcast_shapes(linear.shape, valid.shape, full.shape)
    linear = np.broadcast_to(linear, shape).reshape(num_q, -1)
    valid = np.broadcast_to(valid, shape).reshape(num_q, -1)
    full = np.broadcast_to(full, shape).reshape(num_q, -1)
    kv_count, kv_idx = _compact(valid & ~full, linear)
    full_count, full_idx = _compact(valid & full, linear)
    num_kv = math.prod(d.groups for d in dims) * math.prod(kv_per_group)
    return BlockMask(num_q, num_kv, kv_count, kv_idx, full_count, full_idx)


def _one_d(problem: Problem, tiles: TileConfig) -> BlockMask:
    from .tiling1d import block_lists_1d  # numba: imported on first use

    offsets, indices, flags, visited, _ = block_lists_1d(problem, tiles.q_tokens, tiles.kv_tokens)
    num_q, num_kv = _dense_tile_counts(problem, tiles)
    width = max(int(visited.max(initial=0)), 1)
    rows = np.repeat(np.arange(num_q), visited)
    cols = np.arange(len(indices)) - offsets[rows]
    index = np.zeros((num_q, width), np.int64)
    is_full = np.zeros((num_q, width), dtype=bool)
    present = np.zeros((num_q, width), dtype=bool)
    index[rows, cols] = indices
    is_full[rows, cols] = flags
    present[rows, cols] = True
    kv_count, kv_idx = _compact(present & ~is_full, index)
    full_count, full_idx = _compact(present & is_full, index)
    return BlockMask(num_q, num_kv, kv_count, kv_idx, full_count, full_idx)


def block_mask(problem: Problem, tiles: TileConfig) -> BlockMask:
    """The visited (Q tile, KV tile) pairs of `problem` under `tiles`, split into partial and full.

    Needs static KV tiling: dynamic KV tiles start at a different place for every Q tile, so they
    have no shared grid to index.
    """
    if tiles.kv_tiling != "static":
        raise ValueError(
            "block_mask needs static KV tiling (dynamic KV tiles have no common grid to index), "
            f"got kv_tiling={tiles.kv_tiling!r}."
        )
    if tiles.tiling == "1d":
        return _one_d(problem, tiles)
    return _multi_d(problem, tiles)
