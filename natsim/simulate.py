"""The tile simulator: visited tiles and speedup bounds of a GNA problem under a tile configuration.

Figures are defined in gna-semantics.md, section 3. Multi-D tiling uses the per-dimension
factorisation (natsim.dimension); 1-D tiling is counted exactly by natsim.tiling1d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .dimension import ceil_div, dim_attended_pairs, dim_tiles, dim_totals
from .problem import Problem
from .tiles import TileConfig

FIGURES = (
    "sparsity",
    "flop_speedup",
    "visited_tiles",
    "full_tiles",
    "max_kv_tiles",
    "dense_tiles",
    "tile_speedup",
    "tile_speedup_mean",
    "block_sparse",
)


@dataclass(frozen=True)
class SimResult:
    """Every figure of one (problem, tile configuration), plus per-Q-tile counts when asked for.

    `per_q_tile_visited[i]` / `per_q_tile_full[i]` count the KV tiles Q tile i visits / runs unmasked.
    Multi-D Q tiles are numbered as the permuted layout stores them: dilation groups first
    (row-major over dimensions), then tiles row-major within a group.
    """

    problem: Problem
    tiles: TileConfig
    attended_pairs: int
    num_q_tiles: int
    num_kv_tiles: int
    visited_tiles: int
    full_tiles: int
    max_kv_tiles: int
    per_q_tile_visited: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    per_q_tile_full: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    @property
    def sparsity(self) -> float:
        n = self.problem.num_tokens
        return 1.0 - self.attended_pairs / (n * n)

    @property
    def flop_speedup(self) -> float:
        n = self.problem.num_tokens
        return n * n / self.attended_pairs

    @property
    def dense_tiles(self) -> int:
        return self.num_q_tiles * self.num_kv_tiles

    @property
    def tile_speedup(self) -> float:
        return self.num_kv_tiles / self.max_kv_tiles

    @property
    def tile_speedup_mean(self) -> float:
        return self.dense_tiles / self.visited_tiles

    @property
    def block_sparse(self) -> bool:
        return self.full_tiles == self.visited_tiles

    def to_dict(self) -> dict:
        """A JSON-ready record: the configuration (lists per dimension) and every figure."""
        record = {**self.problem.to_dict(), **self.tiles.to_dict()}
        for name in FIGURES:
            value = getattr(self, name)
            record[name] = value if isinstance(value, (bool, float)) else int(value)
        return record


def _dense_tile_counts(problem: Problem, tiles: TileConfig) -> tuple[int, int]:
    if tiles.tiling == "1d":
        n = problem.num_tokens
        return ceil_div(n, tiles.q_tokens), ceil_div(n, tiles.kv_tokens)
    q_tile, kv_tile = tiles.dims(problem)
    num_q = math.prod(ceil_div(L, t) for L, t in zip(problem.shape, q_tile))
    num_kv = math.prod(ceil_div(L, t) for L, t in zip(problem.shape, kv_tile))
    return num_q, num_kv


def per_dimension(problem: Problem, tiles: TileConfig):
    """The per-dimension tile counts (natsim.dimension.DimTiles) of a multi-D configuration."""
    q_tile, kv_tile = tiles.dims(problem)
    return [
        dim_tiles(L, w, s, d, c, tq, tkv, tiles.kv_tiling == "dynamic")
        for L, w, s, d, c, tq, tkv in zip(
            problem.shape, problem.window, problem.stride, problem.dilation, problem.causal,
            q_tile, kv_tile,
        )
    ]


def outer_per_q_tile(arrays: list[np.ndarray]) -> np.ndarray:
    """Multiply per-dimension `[group, tile]` arrays into per-Q-tile values in permuted order.

    The result is indexed `(g_1, ..., g_n, t_1, ..., t_n)` flattened row-major.
    """
    out = np.ones((1,), np.int64)
    for a in arrays:
        out = np.multiply.outer(out, a)
    out = out.reshape(out.shape[1:])  # axes: g1, t1, g2, t2, ...
    n = len(arrays)
    order = [2 * i for i in range(n)] + [2 * i + 1 for i in range(n)]
    return out.transpose(order).reshape(-1)


def simulate(problem: Problem, tiles: TileConfig, per_q_tile: bool = False) -> SimResult:
    """Simulate `problem` under `tiles` and return every figure (and per-Q-tile counts if asked)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a natsim.Problem, got {type(problem).__name__}.")
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"tiles must be a natsim.TileConfig, got {type(tiles).__name__}.")
    num_q, num_kv = _dense_tile_counts(problem, tiles)
    pairs = math.prod(
        dim_attended_pairs(L, w, s, d, c)
        for L, w, s, d, c in zip(
            problem.shape, problem.window, problem.stride, problem.dilation, problem.causal
        )
    )
    visited_arr = full_arr = None
    if tiles.tiling == "1d":
        from .tiling1d import count_1d  # numba: imported on first use to keep `import natsim` fast

        visited_arr, full_arr = count_1d(problem, tiles.q_tokens, tiles.kv_tokens)
        visited, full, most = int(visited_arr.sum()), int(full_arr.sum()), int(visited_arr.max())
    elif per_q_tile:
        dims = per_dimension(problem, tiles)
        visited = math.prod(int(d.visited.sum()) for d in dims)
        full = math.prod(int(d.full.sum()) for d in dims)
        most = math.prod(int(d.visited.max()) for d in dims)
        visited_arr = outer_per_q_tile([d.visited for d in dims])
        full_arr = outer_per_q_tile([d.full for d in dims])
    else:
        q_tile, kv_tile = tiles.dims(problem)
        totals = [
            dim_totals(L, w, s, d, c, tq, tkv, tiles.kv_tiling == "dynamic")
            for L, w, s, d, c, tq, tkv in zip(
                problem.shape, problem.window, problem.stride, problem.dilation, problem.causal, q_tile, kv_tile,
            )
        ]
        visited, full, most = (math.prod(t[i] for t in totals) for i in range(3))
    return SimResult(
        problem=problem,
        tiles=tiles,
        attended_pairs=pairs,
        num_q_tiles=num_q,
        num_kv_tiles=num_kv,
        visited_tiles=visited,
        full_tiles=full,
        max_kv_tiles=most,
        per_q_tile_visited=visited_arr if per_q_tile else None,
        per_q_tile_full=full_arr if per_q_tile else None,
    )
