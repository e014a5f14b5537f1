"""`best(shape, target_sparsity)`: choose window, stride and tiles for a token layout, fastest first.

The search:
1. windows: the user's, kept as is, or the candidates of planner.search.windows (meeting the target, close to it,
   shaped like the layout, aligned to KV tiles first);
2. per window, strides per dimension from {1, 2, 4, 8, ...} and the window itself (capped by
   `max_stride`) and every tile configuration of the catalog, simulated in bulk with `natsim.sweep`;
3. scored with the cost model of the GPU at hand (predicted seconds), or without one by tile work; with
   `training=True` by forward + backward (planner.cost.predict), the backward by its own coefficients, or
   by tile work for both where the cost model has none;
4. among the configurations within TIE_TOLERANCE (2%) of the best score the smallest stride product
   wins: a larger stride gives up translational equivariance, so it must buy more than noise.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from natsim import SweepResult, TileConfig, simulate, sweep
from natsim.dimension import ceil_div
from natsim.kernels.gna.checks import kernel_tiles
from natsim.kernels.gna.launch import permutes
from natsim.tiles import KV_TILINGS
from natsim.problem import IntOrInts, BoolOrBools, Problem, as_bools, as_ints, as_shape

from ..catalog import as_dtype, check_head_dim, dtype_name, element_bytes, tile_catalog
from ..cost.features import feature_matrix, sweep_features, tile_arrays
from ..cost.files import cost_model_for
from ..cost.gpus import gpu_of
from ..cost.model import CostModel
from ..cost.predict import backward_breakdown, backward_score, backward_scores
from ..plans.candidates import Candidate, Search
from ..plans.plan import Plan
from ..plans.ranking import BASIS_COST_MODEL, BASIS_TILES, TIE_TOLERANCE
from .parallel import parallel_plan
from .windows import candidate_windows, window_sparsity

# Plans have no dilation, so on GPUs with tensor descriptors (those with coefficients) the kernel reads q, k, v
# in place: no permutation (natsim.kernels.gna.launch.permutes).
PERMUTES = False
DENSE_TILE = 128
RUNNERS_UP = 4
TOP = 20

COLUMNS = ("attended_pairs", "visited_tiles", "full_tiles", "max_kv_tiles", "num_kv_tiles")


def stride_candidates(window: Sequence[int], max_stride: Optional[Sequence[int]] = None) -> list[tuple[int, ...]]:
    """Strides to score: per dimension the powers of two below the window and the window itself."""
    per_dim = []
    for i, w in enumerate(window):
        cap = w if max_stride is None else min(w, max_stride[i])
        values = {1 << k for k in range(w.bit_length()) if 1 << k <= cap}
        if w <= cap:
            values.add(w)
        per_dim.append(sorted(values))
    return list(itertools.product(*per_dim))


def kv_tilings_of(cost_model: Optional[CostModel]) -> tuple[str, ...]:
    """The KV tiling modes to score: those the cost model was calibrated on (`CostModel.kv_tilings`), or both
    without one (simulated tile work counts either mode's tiles exactly)."""
    return KV_TILINGS if cost_model is None else cost_model.kv_tilings


def choose(scores: np.ndarray, stride_products: np.ndarray, tolerance: float = TIE_TOLERANCE) -> int:
    """Index of the winner: the smallest stride product among scores within `tolerance` of the best,
    then the best score among those (then the first)."""
    scores = np.asarray(scores, np.float64)
    tied = np.nonzero(scores <= scores.min() * (1.0 + tolerance))[0]
    order = np.lexsort((scores[tied], np.asarray(stride_products)[tied]))
    return int(tied[order[0]])


def _check_sparsity(target_sparsity: object) -> float:
    if not isinstance(target_sparsity, numbers.Real) or isinstance(target_sparsity, bool):
        raise TypeError(f"target_sparsity must be a number, got {target_sparsity=}.")
    if not 0.0 <= float(target_sparsity) < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {target_sparsity=}.")
    return float(target_sparsity)


def _check_heads(heads: object) -> Optional[int]:
    if heads is None:
        return None
    if not isinstance(heads, numbers.Integral) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"heads must be a positive integer or None, got {heads=}.")
    return int(heads)


class _Scorer:
    """Scores sweep rows: predicted seconds with a cost model, tile work without."""

    def __init__(self, shape, catalog, cost_model, batch_heads, head_dim, element_bytes):
        self.tile = tile_arrays(shape, catalog)
        self.tokens = math.prod(shape)
        self.cost_model = cost_model
        self.batch_heads = batch_heads
        self.head_dim = head_dim
        self.element_bytes = element_bytes

    def features(self, tile_index: np.ndarray, visited: np.ndarray, full: np.ndarray) -> np.ndarray:
        return feature_matrix(
            full_tiles=full,
            visited_tiles=visited,
            q_tokens=self.tile["q_tokens"][tile_index],
            kv_tokens=self.tile["kv_tokens"][tile_index],
            q_padded=self.tile["q_padded"][tile_index],
            kv_padded=self.tile["kv_padded"][tile_index],
            tokens=self.tokens,
            batch_heads=self.batch_heads,
            head_dim=self.head_dim,
            element_bytes=self.element_bytes,
            permutation=PERMUTES,
        )

    def score(self, tile_index: np.ndarray, visited: np.ndarray, full: np.ndarray) -> np.ndarray:
        if self.cost_model is None:
            return visited * (self.tile["q_tokens"][tile_index] * self.tile["kv_tokens"][tile_index]).astype(np.float64)
        return self.cost_model.predict(self.features(tile_index, visited, full))

    def dense_score(self) -> float:
        """Dense self attention as `gna_attention` runs it: 1-D over the flattened layout, 128-token tiles."""
        n = self.tokens
        result = simulate(Problem((n,), (n,)), TileConfig(DENSE_TILE, DENSE_TILE, tiling="1d"))
        if self.cost_model is None:
            return float(result.visited_tiles * DENSE_TILE * DENSE_TILE)
        padded = ceil_div(n, DENSE_TILE) * DENSE_TILE
        features = feature_matrix(
            full_tiles=np.array([result.full_tiles]), visited_tiles=np.array([result.visited_tiles]),
            q_tokens=np.array([DENSE_TILE]), kv_tokens=np.array([DENSE_TILE]), q_padded=np.array([padded]),
            kv_padded=np.array([padded]), tokens=n, batch_heads=self.batch_heads, head_dim=self.head_dim,
            element_bytes=self.element_bytes, permutation=False,
        )
        return float(self.cost_model.predict(features)[0])


def predicted_times(
    result: SweepResult,
    cost_model: CostModel,
    *,
    heads: int = 1,
    head_dim: int = 128,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
) -> np.ndarray:
    """Predicted seconds of every configuration of a sweep under `cost_model`, as `best` scores them: one
    GNA call of `heads` heads at batch 1, with the permutation's cost where the call permutes (dilation). The
    sweep must use multi-D tiles (the kernel's)."""
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a natsim.planner.CostModel, got {type(cost_model).__name__}.")
    for tiles in result.tiles:
        if tiles.tiling != "multi":
            raise ValueError(f"predicted times need multi-D tiles (what the GNA kernel runs), got tiling={tiles.tiling!r}.")
        kernel_tiles(result.problem, tiles.q_tile, tiles.kv_tile)  # tiles the kernel cannot run have no time
    features = sweep_features(
        result,
        batch_heads=_check_heads(heads) or 1,
        head_dim=check_head_dim(head_dim),
        element_bytes=element_bytes(as_dtype(dtype)),
        permutation=permutes(result.problem),
    )
    return cost_model.predict(features)


def fastest_first(result: SweepResult, seconds: np.ndarray, pruned: bool = True) -> np.ndarray:
    """Row indices of a sweep by predicted `seconds`, fastest first (then the smaller stride product).

    `pruned` keeps the GNA paper's pruned view with time in place of tile speedup: a configuration stays only
    if it is predicted faster than every configuration with a smaller stride product.
    """
    seconds = np.asarray(seconds, np.float64)
    products = result.stride_product
    rows = np.arange(len(result))
    if pruned:
        levels, level_of_row = np.unique(products, return_inverse=True)
        best_per_level = np.full(len(levels), np.inf)
        np.minimum.at(best_per_level, level_of_row, seconds)
        best_below = np.concatenate(([np.inf], np.minimum.accumulate(best_per_level)[:-1]))
        rows = np.nonzero(seconds < best_below[level_of_row] * (1 - 1e-12))[0]
    return rows[np.lexsort((products[rows], seconds[rows]))]


def _runner_up_rows(rows: dict, scores: np.ndarray, chosen: int) -> list[int]:
    """Rows worth showing beside the winner, best score first: the best row of every other window
    (up to RUNNERS_UP) and, unless the winner has stride 1, the best stride-1 row of its window (what
    neighborhood attention would cost)."""
    windows = rows["window_index"]
    picked = []
    for index in np.unique(windows):
        if index != windows[chosen]:
            members = np.nonzero(windows == index)[0]
            picked.append(int(members[np.argmin(scores[members])]))
    picked = sorted(picked, key=lambda row: scores[row])[:RUNNERS_UP]
    unit = (windows == windows[chosen]) & (rows["stride"] == 1).all(axis=1)
    if unit.any() and not unit[chosen]:
        members = np.nonzero(unit)[0]
        picked.append(int(members[np.argmin(scores[members])]))
    return sorted(picked, key=lambda row: scores[row])


@dataclass(frozen=True)
class _Request:
    """The arguments of `best`, normalised and checked once."""

    shape: tuple[int, ...]
    target: float
    heads: Optional[int]
    head_dim: int
    dtype: torch.dtype
    causal: tuple[bool, ...]
    window: Optional[tuple[int, ...]]
    max_stride: Optional[tuple[int, ...]]
    gpu: Optional[str]
    cost_model: Optional[CostModel]
    training: bool = False


def _normalise(shape, target_sparsity, heads, head_dim, dtype, causal, window, max_stride, device, cost_model,
               training=False) -> _Request:
    shape = as_shape(shape)
    ndim = len(shape)
    target = _check_sparsity(target_sparsity)
    causal = as_bools(causal, ndim, "causal")
    if max_stride is not None:
        max_stride = as_ints(max_stride, ndim, "max_stride")
        if any(s < 1 for s in max_stride):
            raise ValueError(f"max_stride must be at least 1 along every dimension, got {max_stride=}.")
    if window is not None:
        window = Problem(shape, window, causal=causal).window
        achieved = window_sparsity(shape, window, causal)
        if achieved < target:
            raise ValueError(f"window={window} has sparsity {achieved:.6f} on shape={shape}, below {target_sparsity=}.")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a natsim.planner.CostModel, got {type(cost_model).__name__}.")
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {training=}.")
    gpu = cost_model.gpu if cost_model is not None else gpu_of(device)
    cost_model = cost_model if cost_model is not None else cost_model_for(gpu)
    if training and cost_model is not None and cost_model.backward_coefficients is None:
        cost_model = None  # forward seconds and backward tile work do not add up: tile work for both
    return _Request(
        shape=shape,
        target=target,
        heads=_check_heads(heads),
        head_dim=check_head_dim(head_dim),
        dtype=as_dtype(dtype),
        causal=causal,
        window=window,
        max_stride=max_stride,
        gpu=gpu,
        cost_model=cost_model,
        training=training,
    )


def _sweep_windows(request: _Request, windows, catalog: list[TileConfig]) -> dict[str, np.ndarray]:
    """Simulated counts of every (window, stride, tile) row, as columns; `window_index` names the window."""
    parts = []
    for i, w in enumerate(windows):
        result = sweep(
            request.shape, w, strides=stride_candidates(w, request.max_stride), causal=request.causal, tiles=catalog
        )
        part = {name: getattr(result, name) for name in COLUMNS}
        part.update(stride=result.stride, tile_index=result.tile_index, window_index=np.full(len(result), i))
        parts.append(part)
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def best(
    shape: IntOrInts,
    target_sparsity: float,
    *,
    heads: Optional[int] = None,
    head_dim: int = 128,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
    causal: BoolOrBools = False,
    window: Optional[IntOrInts] = None,
    max_stride: Optional[IntOrInts] = None,
    device: Union[None, str, torch.device] = None,
    cost_model: Optional[CostModel] = None,
    training: bool = False,
    world_size: Optional[int] = None,
) -> Plan:
    """The fastest GNA configuration of `shape` whose sparsity is at least `target_sparsity`.

    `heads` (batch 1) scales the predicted time (None: one head); `head_dim` and `dtype` select the tile
    catalog; `causal` applies per dimension; `window` fixes the window (it must meet the target);
    `max_stride` caps the stride per dimension; `device` picks the GPU whose stored coefficients rank the
    configurations (None: the current CUDA device), unless `cost_model` is given. Without coefficients the
    plan ranks by simulated tile work and says so (`plan.basis`, `plan.explain()`). `training` ranks by
    forward + backward time (the backward's own coefficients; without them, forward + backward tile work).
    `world_size=P`: a `planner.plans.parallel.ParallelPlan` for P ranks sharding frames (planner.search.parallel),
    which knows its strategy and split.

    >>> plan = best((30, 48, 80), 0.9, heads=24)   # doctest: +SKIP
    >>> out = plan(q, k, v)                        # doctest: +SKIP
    """
    r = _normalise(shape, target_sparsity, heads, head_dim, dtype, causal, window, max_stride, device, cost_model,
                   training)
    catalog = tile_catalog(r.shape, r.head_dim, kv_tilings_of(r.cost_model))
    if r.window is not None:
        windows, band = (r.window,), None
    else:
        found = candidate_windows(r.shape, r.target, r.causal, catalog)
        windows, band = found.windows, found.band

    # Every row meets the target: a window admissible at stride 1 attends no more keys at larger strides.
    rows = _sweep_windows(r, windows, catalog)
    scorer = _Scorer(r.shape, catalog, r.cost_model, r.heads or 1, r.head_dim, element_bytes(r.dtype))
    scores = scorer.score(rows["tile_index"], rows["visited_tiles"], rows["full_tiles"])
    call = dict(batch_heads=r.heads or 1, head_dim=r.head_dim, element_bytes=element_bytes(r.dtype))
    if r.training:
        backward = backward_scores(r.shape, r.causal, windows, rows["window_index"], rows["stride"], r.cost_model,
                                   **call)
        scores = scores + backward
    chosen = choose(scores, rows["stride"].prod(axis=1))
    n = math.prod(r.shape)

    def candidate(row: int) -> Candidate:
        tiles = catalog[int(rows["tile_index"][row])]
        return Candidate(
            window=windows[int(rows["window_index"][row])],
            stride=tuple(int(s) for s in rows["stride"][row]),
            q_tile=tiles.q_tile,
            kv_tile=tiles.kv_tile,
            score=float(scores[row]),
            sparsity=1.0 - float(rows["attended_pairs"][row]) / (n * n),
            tile_speedup=float(rows["num_kv_tiles"][row] / rows["max_kv_tiles"][row]),
            block_sparse=bool(rows["full_tiles"][row] == rows["visited_tiles"][row]),
            kv_tiling=tiles.kv_tiling,
            backward_score=float(backward[row]) if r.training else None,
        )

    winner = candidate(chosen)
    breakdown = {}
    if r.cost_model is not None:
        picked = [chosen]
        breakdown = r.cost_model.breakdown(
            scorer.features(rows["tile_index"][picked], rows["visited_tiles"][picked], rows["full_tiles"][picked])[0]
        )
        if r.training:
            breakdown.update(backward_breakdown(Problem(r.shape, winner.window, winner.stride, causal=r.causal),
                                                r.cost_model, **call))
    dense = Problem(r.shape, r.shape)
    dense_backward = backward_score(dense, r.cost_model, **call) if r.training else None
    plan = Plan(
        problem=Problem(r.shape, winner.window, winner.stride, causal=r.causal),
        tiles=TileConfig(winner.q_tile, winner.kv_tile, kv_tiling=winner.kv_tiling),
        target_sparsity=r.target,
        head_dim=r.head_dim,
        dtype=dtype_name(r.dtype),
        heads=r.heads,
        gpu=r.gpu,
        basis=BASIS_COST_MODEL if r.cost_model is not None else BASIS_TILES,
        score=winner.score,
        dense_score=scorer.dense_score() + (dense_backward or 0.0),
        breakdown=breakdown,
        runners_up=tuple(candidate(row) for row in _runner_up_rows(rows, scores, chosen)),
        search=Search(
            windows=tuple(windows),
            window_given=band is None,
            band=band,
            scored=int(len(scores)),
            top=tuple(candidate(int(row)) for row in np.argsort(scores, kind="stable")[:TOP]),
            tie_tolerance=TIE_TOLERANCE,
            kv_tilings=kv_tilings_of(r.cost_model),
        ),
        training=r.training,
        backward_score=winner.backward_score,
        dense_backward_score=dense_backward,
    )
    if world_size is None:
        return plan
    return parallel_plan(plan, world_size)
