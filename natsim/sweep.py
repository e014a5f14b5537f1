"""Sweeps over strides and tile configurations, with the GNA paper's pruned view (its section 4.1).

Multi-D configurations are evaluated in bulk: each dimension's totals are computed once per (stride, tile
side) along that dimension, all of them in one numpy pass (natsim.dimension.dim_totals_many), and combined by
products, so a sweep over every stride of a 3-D window costs little more than the strides of its three
dimensions.
1-D tiling does not factorise and is simulated configuration by configuration.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from .dimension import dim_attended_pairs, dim_totals_many
from .problem import IntOrInts, BoolOrBools, Problem
from .simulate import SimResult, _dense_tile_counts, simulate
from .tiles import TileConfig

Progress = Callable[[int, int], None]

CATALOG_TOKENS = (64, 128, 256)


def default_tile_catalog(shape: Sequence[int], tokens: Iterable[int] = CATALOG_TOKENS) -> list[TileConfig]:
    """Multi-D tile configurations with power-of-two tile shapes of 64, 128 and 256 tokens.

    The Q and KV tiles share one shape; no side is longer than the next power of two of its
    dimension (a longer side would hold only padding).
    """
    limits = [1 << (length - 1).bit_length() for length in shape]
    catalog = []
    for total in tokens:
        exponent = total.bit_length() - 1
        for parts in itertools.product(range(exponent + 1), repeat=len(shape)):
            if sum(parts) != exponent:
                continue
            tile = tuple(1 << p for p in parts)
            if all(t <= limit for t, limit in zip(tile, limits)):
                catalog.append(TileConfig(tile, tile))
    return catalog


def all_strides(problem: Problem) -> np.ndarray:
    """Every stride from 1 to the window along each dimension, as an `(n, ndim)` array."""
    axes = [np.arange(1, w + 1) for w in problem.window]
    grid = np.meshgrid(*axes, indexing="ij")
    return np.stack([g.reshape(-1) for g in grid], axis=1)


@dataclass(frozen=True)
class SweepResult:
    """Sweep results as columns: row i is `stride[i]` under `tiles[tile_index[i]]`.

    The count columns mirror `SimResult`; `result(i)` gives row i as a `SimResult`.
    """

    problem: Problem
    tiles: tuple[TileConfig, ...]
    stride: np.ndarray
    tile_index: np.ndarray
    attended_pairs: np.ndarray
    num_q_tiles: np.ndarray
    num_kv_tiles: np.ndarray
    visited_tiles: np.ndarray
    full_tiles: np.ndarray
    max_kv_tiles: np.ndarray

    def __len__(self) -> int:
        return len(self.tile_index)

    @property
    def stride_product(self) -> np.ndarray:
        return self.stride.prod(axis=1)

    @property
    def tile_speedup(self) -> np.ndarray:
        return self.num_kv_tiles / self.max_kv_tiles

    @property
    def block_sparse(self) -> np.ndarray:
        return self.full_tiles == self.visited_tiles

    @property
    def pruned(self) -> np.ndarray:
        """Rows kept by the paper's pruning: a configuration survives only if its tile speedup beats
        every configuration with a smaller stride product (larger strides cost translational
        equivariance, so they must buy speed)."""
        products = self.stride_product
        speedup = self.tile_speedup
        levels, level_of_row = np.unique(products, return_inverse=True)
        best_per_level = np.full(len(levels), -np.inf)
        np.maximum.at(best_per_level, level_of_row, speedup)
        best_below = np.concatenate(([-np.inf], np.maximum.accumulate(best_per_level)[:-1]))
        return speedup > best_below[level_of_row] * (1 + 1e-12)

    def order(self, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """Row indices best first: highest tile speedup, then smallest stride product."""
        rows = np.arange(len(self)) if rows is None else rows
        keys = (self.stride_product[rows], -self.tile_speedup[rows])
        return rows[np.lexsort(keys)]

    def result(self, i: int) -> SimResult:
        """Row `i` as a SimResult."""
        return SimResult(
            problem=self.problem.with_stride(tuple(int(s) for s in self.stride[i])),
            tiles=self.tiles[int(self.tile_index[i])],
            attended_pairs=int(self.attended_pairs[i]),
            num_q_tiles=int(self.num_q_tiles[i]),
            num_kv_tiles=int(self.num_kv_tiles[i]),
            visited_tiles=int(self.visited_tiles[i]),
            full_tiles=int(self.full_tiles[i]),
            max_kv_tiles=int(self.max_kv_tiles[i]),
        )

    def best(self, pruned: bool = True, limit: Optional[int] = None) -> list[SimResult]:
        """The rows (pruned view by default) as SimResults, best first."""
        rows = np.nonzero(self.pruned)[0] if pruned else None
        ordered = self.order(rows)[:limit]
        return [self.result(int(i)) for i in ordered]


def _normalise_strides(problem: Problem, strides: Optional[Iterable[IntOrInts]]) -> np.ndarray:
    if strides is None or (isinstance(strides, str) and strides == "all"):
        return all_strides(problem)
    if isinstance(strides, np.ndarray) and strides.ndim == 2 and strides.shape[1] == problem.ndim \
            and np.issubdtype(strides.dtype, np.integer) and len(strides):
        # A stride table (what the planner passes): checked at once; a bad row raises Problem's own error.
        bad = np.nonzero(((strides < 1) | (strides > np.array(problem.window))).any(axis=1))[0]
        if len(bad):
            problem.with_stride(tuple(int(s) for s in strides[bad[0]]))
        return strides.astype(np.int64)
    if isinstance(strides, (str, bytes)) or not isinstance(strides, Iterable):
        raise TypeError(f"strides must be None, 'all' or a list of strides (each an int or one int per dimension), "
                        f"got strides={strides!r}.")
    rows = list(dict.fromkeys(problem.with_stride(s).stride for s in strides))  # validated; a repeat counted once
    if not rows:
        raise ValueError("strides must hold at least one stride, got an empty list.")
    return np.array(rows, dtype=np.int64)


def _sweep_multi_d(problem: Problem, tiles: Sequence[TileConfig], strides: np.ndarray) -> dict[str, np.ndarray]:
    """The count columns of every multi-D tile configuration under every stride, `[tile, stride]`.

    Each count is a product over dimensions of per-dimension totals (gna-semantics.md, section 2), and a
    dimension's totals depend only on its stride and its tile sides: they are counted once per (stride value,
    Q side, KV side, KV tiling) along each dimension, all at once (natsim.dimension.dim_totals_many), and
    multiplied out for the whole table with numpy.
    """
    names = ("visited_tiles", "full_tiles", "max_kv_tiles")
    columns = {name: np.ones((len(tiles), len(strides)), np.int64) for name in ("attended_pairs", *names)}
    dims = [t.dims(problem) for t in tiles]
    for axis in range(problem.ndim):
        L, w, d, c = (problem.shape[axis], problem.window[axis], problem.dilation[axis], problem.causal[axis])
        values, inverse = np.unique(strides[:, axis], return_inverse=True)
        sides = [(q[axis], kv[axis], t.kv_tiling == "dynamic") for t, (q, kv) in zip(tiles, dims)]
        keys = list(dict.fromkeys(sides))
        side_index = np.array([keys.index(side) for side in sides])
        q_sides, kv_sides, dynamic = (np.array(column) for column in zip(*keys))
        totals = dim_totals_many(L, w, d, c, np.repeat(values, len(keys)), np.tile(q_sides, len(values)),
                                 np.tile(kv_sides, len(values)), np.tile(dynamic, len(values)))
        totals = totals.reshape(len(values), len(keys), 3)  # [stride value, side, (visited, full, most)]
        per_row = totals[:, side_index][inverse.reshape(-1)]  # [stride, tile, 3]
        for i, name in enumerate(names):
            columns[name] *= per_row[:, :, i].T
        pairs = np.array([dim_attended_pairs(L, w, int(s), d, c) for s in values], np.int64)
        columns["attended_pairs"] *= pairs[inverse.reshape(-1)][None, :]
    return columns


def _sweep_one_by_one(
    problem: Problem, tiles: TileConfig, strides: np.ndarray, tick: Callable[[], None]
) -> dict[str, np.ndarray]:
    names = ("attended_pairs", "visited_tiles", "full_tiles", "max_kv_tiles")
    columns = {name: np.zeros(len(strides), np.int64) for name in names}
    for row, stride in enumerate(strides):
        result = simulate(problem.with_stride(tuple(int(s) for s in stride)), tiles)
        for name in names:
            columns[name][row] = getattr(result, name)
        tick()
    return columns


def sweep(
    shape: IntOrInts,
    window: IntOrInts,
    strides: Optional[Iterable[IntOrInts]] = None,
    dilation: IntOrInts = 1,
    causal: BoolOrBools = False,
    tiles: Optional[Sequence[TileConfig]] = None,
    progress: Optional[Progress] = None,
) -> SweepResult:
    """Simulate every (stride, tile configuration) pair.

    `strides`: None or "all" for every stride from 1 to the window along each dimension, or a list
    of strides (each an int or one int per dimension). `tiles`: a list of TileConfigs, by default
    `default_tile_catalog(shape)`. `progress(done, total)` is called as configurations finish.
    """
    problem = Problem(shape, window, 1, dilation, causal)
    stride_rows = _normalise_strides(problem, strides)
    tile_list = tuple(default_tile_catalog(problem.shape) if tiles is None else tiles)
    if not tile_list and tiles is None:
        raise ValueError(
            f"shape={problem.shape} is too small for the default tile catalog (tiles of "
            f"{', '.join(map(str, CATALOG_TOKENS))} tokens, no side longer than the next power of two of its "
            "dimension): pass tiles (`natsim sweep --q-tile ... --kv-tile ...`)."
        )
    if not tile_list:
        raise ValueError("tiles must hold at least one TileConfig, got an empty list.")
    for t in tile_list:
        if not isinstance(t, TileConfig):
            raise TypeError(f"tiles must hold natsim.TileConfig objects, got {type(t).__name__}.")
        if t.tiling == "multi":
            t.dims(problem)  # validates the tile's dimension count against the layout

    total = len(stride_rows) * len(tile_list)
    done = 0

    def tick(count: int = 1) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    multi = {i: k for k, i in enumerate(i for i, tile in enumerate(tile_list) if tile.tiling == "multi")}
    bulk = _sweep_multi_d(problem, [tile_list[i] for i in multi], stride_rows) if multi else {}
    tick(len(stride_rows) * len(multi))
    parts = []
    for i, tile in enumerate(tile_list):
        if tile.tiling == "multi":
            columns = {name: values[multi[i]] for name, values in bulk.items()}
        else:
            columns = _sweep_one_by_one(problem, tile, stride_rows, tick)
        num_q, num_kv = _dense_tile_counts(problem, tile)
        columns["num_q_tiles"] = np.full(len(stride_rows), num_q, np.int64)
        columns["num_kv_tiles"] = np.full(len(stride_rows), num_kv, np.int64)
        parts.append(columns)

    return SweepResult(
        problem=problem,
        tiles=tile_list,
        stride=np.tile(stride_rows, (len(tile_list), 1)),
        tile_index=np.repeat(np.arange(len(tile_list)), len(stride_rows)),
        **{name: np.concatenate([p[name] for p in parts]) for name in parts[0]},
    )
