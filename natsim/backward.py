"""The backward pass's tile counts: the KV-major view of the same static-KV-tiling mask.

A flash-attention backward runs one program per KV tile (dK, dV accumulated over the Q tiles that visit it)
and one per Q tile (dQ, over the KV tiles it visits, as the forward). The (Q tile, KV tile) pairs are the
forward's (gna-semantics.md, section 2, static KV tiling); what changes is who owns them: here each KV tile
counts the Q tiles that visit it and how many of those pairs are full. The numbers come from transposing the
forward's per-dimension visit ranges (natsim.dimension), not from inverting the window, so that the backward
kernel's own inversion (kernels/gna_backward.py) can be held against them.

Multi-D tiles are Cartesian products of per-dimension ranges and a pair is visited (full) iff it is along
every dimension, so the Q tiles visiting a KV tile number the product of the per-dimension counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .dimension import dim_tiles
from .problem import Problem
from .simulate import outer_per_q_tile
from .tiles import TileConfig


@dataclass(frozen=True)
class BackwardSim:
    """KV-major tile counts of one (problem, static multi-D tile configuration).

    `per_kv_tile_visited[i]` / `per_kv_tile_full[i]` count the Q tiles that visit KV tile i / of them the
    full pairs; KV tiles are numbered as the kernels number them (dilation groups first, then tiles row-major
    within a group), padding-only tiles included with zero counts.
    """

    problem: Problem
    tiles: TileConfig
    num_q_tiles: int
    num_kv_tiles: int
    visited_tiles: int
    full_tiles: int
    max_q_tiles: int
    per_kv_tile_visited: np.ndarray = field(repr=False, compare=False)
    per_kv_tile_full: np.ndarray = field(repr=False, compare=False)

    @property
    def tile_speedup(self) -> float:
        """Dense Q tiles per KV tile over the most any KV tile gets: the dK/dV kernel's bound."""
        return self.num_q_tiles / self.max_q_tiles

    @property
    def tile_speedup_mean(self) -> float:
        return self.num_q_tiles * self.num_kv_tiles / self.visited_tiles


def _dim_kv_major(dims) -> tuple[np.ndarray, np.ndarray]:
    """Per dimension, `[group, KV tile]` counts of visiting Q tiles and full pairs, from the forward's
    `[group, Q tile]` visit ranges and full flags."""
    visited = np.zeros((dims.groups, dims.kv_tiles_per_group), np.int64)
    full = np.zeros_like(visited)
    for g in range(dims.groups):
        for j in range(dims.q_tiles_per_group):
            first = int(dims.kv_first[g, j])
            for m in range(int(dims.visited[g, j])):
                visited[g, first + m] += 1
                full[g, first + m] += int(dims.full_flags[g, j, m])
    return visited, full


def simulate_backward(problem: Problem, tiles: TileConfig) -> BackwardSim:
    """KV-major counts of `problem` under `tiles` (multi-D, static KV tiling: what the backward kernel runs)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a natsim.Problem, got {type(problem).__name__}.")
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"tiles must be a natsim.TileConfig, got {type(tiles).__name__}.")
    if tiles.tiling != "multi" or tiles.kv_tiling != "static":
        raise ValueError(
            "the backward's tile counts exist for multi-D tiling with static KV tiling (the backward kernel's), "
            f"got tiling={tiles.tiling!r}, kv_tiling={tiles.kv_tiling!r}."
        )
    q_tile, kv_tile = tiles.dims(problem)
    per_dim = [
        _dim_kv_major(dim_tiles(L, w, s, d, c, tq, tk, False))
        for L, w, s, d, c, tq, tk in zip(problem.shape, problem.window, problem.stride, problem.dilation,
                                         problem.causal, q_tile, kv_tile)
    ]
    visited = outer_per_q_tile([v for v, _ in per_dim])
    full = outer_per_q_tile([f for _, f in per_dim])
    num_q = math.prod(-(-L // t) for L, t in zip(problem.shape, q_tile))
    num_kv = math.prod(-(-L // t) for L, t in zip(problem.shape, kv_tile))
    return BackwardSim(problem, tiles, num_q, num_kv, int(visited.sum()), int(full.sum()), int(visited.max()),
                       visited, full)
