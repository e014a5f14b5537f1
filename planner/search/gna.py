"""`best(shape, target_sparsity)`: choose window, stride and tiles for a token layout, fastest first.

The search:
1. windows: the user's, kept as is, or the candidates of planner.search.windows (meeting the target, close to it,
   shaped like the layout, aligned to KV tiles first);
2. per window, strides per dimension from {1, 2, 4, 8, ...} and the window itself (capped by
   `max_stride`) and every tile configuration of the catalog in the KV tiling modes searched, simulated in bulk
   with `natsim.sweep` (per-dimension totals multiplied out with numpy);
3. scored with the cost model of the GPU asked for (predicted seconds), or without one by tile work; with
   `training=True` by forward + backward (planner.cost.predict), the backward by its own coefficients, or
   by tile work for both where the cost model has none;
4. among the configurations within TIE_TOLERANCE (2%) of the best score the smallest stride product
   wins: a larger stride gives up translational equivariance, so it must buy more than noise.

Each configuration is scored on every kernel backend the search ranks (planner.backends): natsim's Triton
kernels, FlashAttention-4 where it runs the configuration's tiles (planner.search.fa4_scores) and, in FP8,
natsim's Gluon kernel where it does (planner.search.gluon_scores), each priced by its own coefficients; a
configuration's score is its best backend's, so the search ranks (configuration, backend) pairs under the same
tie rule. A backend is priced where its coefficients exist even when it does not run here: the plan records its
best candidate, and what the search would have picked with it.

`precision="fp8"` plans natsim's FP8 inference kernels: the same simulated tile counts, FP8's coefficients
(`CostModel.fp8_coefficients` for the Triton kernel, `gluon_fp8_coefficients` for the Gluon one; without the
first the plan ranks by tile work and says so), static KV tiling and tiles of at least 32 keys (what FP8 runs),
and FP8's own memory passes (quantization, and the permutation of 2-D and 3-D layouts).

`precision="auto"` searches both precisions and keeps FP8's plan only where both are priced by a cost model and
FP8's is predicted faster than bf16's by more than TIE_TOLERANCE (FP8 costs accuracy: a tie goes to bf16); the
plan records both predictions (`plan.search.precisions`).

A search depends only on its normalised arguments (and the cost model's coefficients), so the last plans are
kept (`_search`): a model calls `best` once per layer, mostly with the same layout. A window's simulated counts
depend on the layout, its strides and the tiles alone, so they are kept too (`_window_sweep`), for the searches
that price them otherwise. `world_size=P` prices the plan over P ranks (planner.search.parallel).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import numpy as np
import torch

from natsim import SweepResult, TileConfig, simulate, sweep
from natsim.kernels.backends.triton import DEFAULT_VARIANT, check_precision, fp8_head_split, kernel_tiles, permutes
from natsim.tiles import KV_TILINGS
from natsim.problem import IntOrInts, BoolOrBools, Problem, as_bools, as_ints, as_shape

from ..backends import NAMES, Backends, BackendsLike, backend_choice, check_backends, fa4_gna_refusal
from ..catalog import as_dtype, check_head_dim, dtype_name, element_bytes, tile_catalog
from ..cost.features import copies_rows_of, feature_matrix, splits_heads_of, sweep_features, tile_arrays
from ..cost.files import link_for
from ..cost.model import CostModel
from ..cost.predict import backward_breakdown, backward_score, backward_scores
from ..cost.resolve import CostModelLike, DeviceLike, resolve_cost_model
from ..plans.candidates import Candidate, Search
from ..plans.parallel import ParallelPlan
from ..plans.plan import Plan
from ..plans.ranking import BASIS_COST_MODEL, BASIS_TILES, TIE_TOLERANCE
from .fa4_scores import Fa4Scorer
from .gluon_scores import GluonScorer
from .parallel import check_world_size, halo_runs, parallel_plan
from .windows import candidate_windows, reaches, window_density

AUTO = "auto"  # precision: bf16 or FP8, whichever is predicted faster
DENSE_TILE = 128
FP8_MIN_KV_TOKENS = 32  # FP8's P @ V reduces over the KV tile: fewer keys do not compile (kernels/common/fp8.py)
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


def _check_kv_tiling(kv_tiling: object) -> Optional[str]:
    if kv_tiling is not None and kv_tiling not in KV_TILINGS:
        raise ValueError(f"kv_tiling must be one of {KV_TILINGS} or None (the search chooses), got {kv_tiling=}.")
    return kv_tiling


class _Scorer:
    """Scores sweep rows: predicted seconds with a cost model, tile work without."""

    def __init__(self, shape, catalog, cost_model, batch_heads, head_dim, element_bytes, precision=None):
        self.tile = tile_arrays(shape, catalog)
        self.tokens = math.prod(shape)
        self.cost_model = cost_model
        self.batch_heads = batch_heads
        self.head_dim = head_dim
        self.element_bytes = element_bytes
        self.precision = precision
        self.permutes = permutes(Problem(shape, 1), fp8=precision == "fp8")  # no dilation: the layout decides
        self.copied_rows = copies_rows_of(catalog, head_dim=head_dim, element_bytes=element_bytes,
                                          permutation=self.permutes, quantized=precision == "fp8")
        self.split_heads = splits_heads_of(catalog, head_dim=head_dim, quantized=precision == "fp8")

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
            permutation=self.permutes,
            quantized=self.precision == "fp8",
            copied_rows=self.copied_rows[tile_index],
            split_heads=self.split_heads[tile_index],
        )

    def score(self, tile_index: np.ndarray, visited: np.ndarray, full: np.ndarray) -> np.ndarray:
        if self.cost_model is None:
            return visited * (self.tile["q_tokens"][tile_index] * self.tile["kv_tokens"][tile_index]).astype(np.float64)
        return self.cost_model.predict(self.features(tile_index, visited, full), self.precision)

    def dense_score(self) -> float:
        """Dense self attention as `gna_attention` runs it: 1-D over the flattened layout, 128-token tiles."""
        if self.cost_model is None:
            return float(_dense_tiles(self.tokens)[0] * DENSE_TILE * DENSE_TILE)
        return dense_seconds(self.tokens, self.cost_model, self.batch_heads, self.head_dim, self.element_bytes,
                             self.precision)


def dense_seconds(tokens: int, cost_model: CostModel, batch_heads: int, head_dim: int, element_bytes: int,
                  precision: Optional[str] = None) -> float:
    """Predicted seconds of dense self attention over `tokens` as `gna_attention` runs it on natsim's Triton
    kernel (1-D over the flattened layout, 128-token tiles), in `precision` (None: the inputs' dtype)."""
    visited, full = _dense_tiles(tokens)
    padded = -(-tokens // DENSE_TILE) * DENSE_TILE
    features = feature_matrix(
        full_tiles=np.array([full]), visited_tiles=np.array([visited]),
        q_tokens=np.array([DENSE_TILE]), kv_tokens=np.array([DENSE_TILE]), q_padded=np.array([padded]),
        kv_padded=np.array([padded]), tokens=tokens, batch_heads=batch_heads, head_dim=head_dim,
        element_bytes=element_bytes, permutation=False, quantized=precision == "fp8",
        split_heads=splits_heads_of([TileConfig((DENSE_TILE,), (DENSE_TILE,))], head_dim=head_dim,
                                    quantized=precision == "fp8"),
    )
    return float(cost_model.predict(features, precision)[0])


@functools.lru_cache(maxsize=256)
def _dense_tiles(tokens: int) -> tuple[int, int]:
    """(visited, full) tiles of dense self attention over `tokens` in 128-token runs. A 1-D layout's multi-D
    tiles are its runs of tokens, so the simulator's factorised count gives them at once (1-D tiling counts
    them the same, token by token: seconds for a video layout)."""
    result = simulate(Problem((tokens,), (tokens,)), TileConfig((DENSE_TILE,), (DENSE_TILE,)))
    return result.visited_tiles, result.full_tiles


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
    """Rows worth showing beside the winner, best score first: the best row of every other window (up to
    RUNNERS_UP) and, unless the winner has stride 1, the best stride-1 row of its window (what neighborhood
    attention would cost). Each window's rows are one contiguous run (`rows["window_rows"]`)."""
    runs = rows["window_rows"]
    own = int(rows["window_index"][chosen])
    picked = [start + int(np.argmin(scores[start:stop])) for w, (start, stop) in enumerate(runs) if w != own]
    picked = sorted((row for row in picked if np.isfinite(scores[row])), key=lambda row: scores[row])[:RUNNERS_UP]
    start, stop = runs[own]
    unit = (rows["stride"][start:stop] == 1).all(axis=1) & np.isfinite(scores[start:stop])
    if unit.any() and not unit[chosen - start]:
        members = start + np.nonzero(unit)[0]
        picked.append(int(members[np.argmin(scores[members])]))
    return sorted(picked, key=lambda row: scores[row])


def _best_rows(scores: np.ndarray, count: int) -> np.ndarray:
    """The first `count` rows of `np.argsort(scores, kind="stable")` with a finite score (a row no backend
    ranked runs is infinite), without sorting every row: the rows at or under the count-th smallest score,
    sorted stably (ties stay in row order, as in the full sort)."""
    if len(scores) <= count:
        rows = np.argsort(scores, kind="stable")
    else:
        kth = np.partition(scores, count - 1)[count - 1]
        rows = np.nonzero(scores <= kth)[0]
        rows = rows[np.argsort(scores[rows], kind="stable")][:count]
    return rows[np.isfinite(scores[rows])]


@dataclass(frozen=True)
class _Request:
    """The arguments of a search, normalised and checked once; equal requests make equal plans (`_search` keeps
    them). The cost model is compared by its coefficients (`cost_key`), not by identity."""

    shape: tuple[int, ...]
    target: float
    heads: Optional[int]
    head_dim: int
    dtype: torch.dtype
    causal: tuple[bool, ...]
    window: Optional[tuple[int, ...]]
    max_stride: Optional[tuple[int, ...]]
    gpu: Optional[str]
    cost_model: Optional[CostModel] = field(compare=False)
    cost_key: Optional[str]
    training: bool
    kv_tilings: tuple[str, ...]
    backward_variant: tuple = ()  # the backward kernels' switches (DEFAULT_VARIANT) a training search priced
    kv_tiling_fixed: Optional[str] = None  # Search.kv_tiling_fixed: why the modes were narrowed
    precision: Optional[str] = None
    backends: Backends = Backends()


def ranking(device: DeviceLike, cost_model: Optional[CostModelLike], training: bool,
            kv_tiling: Optional[str], precision: Optional[str] = None
            ) -> tuple[Optional[str], Optional[CostModel], tuple[str, ...]]:
    """`(gpu, cost model, KV tiling modes)` a search ranks with (planner.cost.resolve says which model; None
    ranks by tile work), or a sentence error: a training search needs backward coefficients to rank by time
    (else it ranks forward and backward by tile work), a fixed `kv_tiling` needs a model calibrated on it, and
    FP8 is for inference with static KV tiling (without FP8 coefficients it ranks by tile work)."""
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {training=}.")
    kv_tiling = _check_kv_tiling(kv_tiling)
    if check_precision(precision) == "fp8":
        if training:
            raise ValueError("precision='fp8' is for inference (its kernels have no backward pass), so training must "
                             "be False; plan training in bfloat16 (precision=None).")
        if kv_tiling == "dynamic":
            raise ValueError("precision='fp8' runs static KV tiling only, got kv_tiling='dynamic'; pass "
                             "kv_tiling='static' or None.")
        gpu, model = resolve_cost_model(device, cost_model)
        if model is not None and not model.has("gna-fp8"):
            model = None  # the bf16 kernel's seconds say little about FP8's: rank by tile work, as without a model
        return gpu, model, ("static",)
    gpu, model = resolve_cost_model(device, cost_model)
    if training and model is not None and model.backward_coefficients is None:
        model = None  # forward seconds and backward tile work do not add up: tile work for both
    if kv_tiling is None:
        return gpu, model, kv_tilings_of(model)
    if model is not None and kv_tiling not in model.kv_tilings:
        raise ValueError(
            f"kv_tiling={kv_tiling!r} needs coefficients calibrated on that kernel, but those of {model.gpu} cover "
            f"{' and '.join(model.kv_tilings)} KV tiling only; run `natsim calibrate` on that GPU, or pass "
            f"kv_tiling={model.kv_tilings[0]!r} or None."
        )
    return gpu, model, (kv_tiling,)


def _excluded(world_size: Optional[int], kv_tiling: Optional[str], precision: Optional[str]) -> dict[str, str]:
    """Why a backend has no place in a search with these arguments, per backend (planner.backends.backend_choice)."""
    why = {}
    if precision is not None:
        why["fa4"] = (f"it runs no FP8 on the GPUs natsim runs it on, so precision={precision!r} plans natsim's FP8 "
                      "kernels")
    else:
        why["gluon"] = "it runs GNA in precision='fp8' only (its 16-bit variant runs block masks: best_mask)"
    if world_size is not None:
        why["fa4"] = (f"natsim.distributed runs natsim's Triton kernels, so a plan over world_size={world_size} ranks "
                      "runs them")
    elif kv_tiling == "dynamic":
        why["fa4"] = "it runs static KV tiling only, so kv_tiling='dynamic' plans natsim's Triton kernels"
    return why


def _normalise(shape, target_sparsity, heads, head_dim, dtype, causal, window, max_stride, device, cost_model,
               training, world_size, kv_tiling, precision=None, backends: BackendsLike = None) -> _Request:
    """Check every argument of `best` and resolve its cost model: the search's request, or one sentence error
    for the first argument, or combination, that no plan can honour (`world_size` is checked, not searched)."""
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
        density = window_density(shape, window, causal)
        if not reaches(density, target):
            raise ValueError(f"window={window} has sparsity {1.0 - density:.6f} on shape={shape}, below "
                             f"{target_sparsity=}.")
    heads = _check_heads(heads)
    head_dim = check_head_dim(head_dim)
    if precision == "fp8":
        fp8_head_split(head_dim)  # the FP8 kernels' head dims, refused with their sentence before any search
    dtype = as_dtype(dtype)
    gpu, model, kv_tilings = ranking(device, cost_model, training, kv_tiling, precision)
    choice = backend_choice(backends, device=device, model=model, training=training, gpu=gpu,
                            excluded=_excluded(world_size, kv_tiling, precision), fp8=precision == "fp8")
    if world_size is not None:
        check_world_size(world_size, shape[0])
        if precision is not None:
            raise ValueError(f"precision={precision!r} plans one GPU: natsim.distributed runs bfloat16 / float16 only, "
                             f"so world_size must be None, got {world_size=}.")
    request = _Request(
        shape=shape, target=target, heads=heads, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
        max_stride=max_stride, gpu=gpu, cost_model=model,
        cost_key=None if model is None else json.dumps(model.to_dict(), sort_keys=True),
        training=training, kv_tilings=kv_tilings,
        backward_variant=tuple(sorted(DEFAULT_VARIANT.items())) if training else (),
        kv_tiling_fixed="precision" if precision is not None else (None if kv_tiling is None else "kv_tiling"),
        precision=precision,
        backends=choice,
    )
    return request


@functools.lru_cache(maxsize=512)
def _window_sweep(shape: tuple[int, ...], window: tuple[int, ...], causal: tuple[bool, ...],
                  max_stride: Optional[tuple[int, ...]], catalog: tuple[TileConfig, ...]) -> tuple[int, dict]:
    """One window's strides (their count) and its simulated count columns under every tile of `catalog`, read-only.

    The counts depend on the layout, the window, its strides and the tiles alone, not on what prices them: the
    searches of one layout for other head dims, dtypes, cost models, training or precision share them (a model's
    layers, the CLI and `precision="auto"` ask for several), so the last ones are kept."""
    strides = np.array(stride_candidates(window, max_stride), np.int64)
    result = sweep(shape, window, strides=strides, causal=causal, tiles=catalog)
    part = {name: getattr(result, name) for name in COLUMNS}
    part.update(stride=result.stride, tile_index=result.tile_index)
    for column in part.values():
        column.flags.writeable = False
    return len(strides), part


def _sweep_windows(request: _Request, windows, catalog: list[TileConfig]) -> tuple[dict[str, np.ndarray], list]:
    """Simulated counts of every (window, stride, tile) row, as columns, and the (window, stride) problems.

    `window_index` names a row's window, `key_index` its problem (rows of one window and stride share it,
    whatever their tiles: the backward runs its own); `window_rows` holds each window's run of rows.
    """
    parts, problems, runs, offset = [], [], [], 0
    for i, w in enumerate(windows):
        count, swept = _window_sweep(request.shape, tuple(w), request.causal, request.max_stride, tuple(catalog))
        rows = len(swept["tile_index"])
        part = dict(swept, window_index=np.full(rows, i),
                    key_index=len(problems) + np.tile(np.arange(count), len(catalog)))
        parts.append(part)
        problems += [(i, tuple(int(v) for v in stride)) for stride in swept["stride"][:count]]
        runs.append((offset, offset + rows))
        offset += rows
    rows = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    rows["window_rows"] = runs
    return rows, problems


@functools.lru_cache(maxsize=64)
def _search(r: _Request) -> Plan:
    """The single-GPU plan of a normalised request (module docstring: the search)."""
    catalog = tile_catalog(r.shape, r.head_dim, r.kv_tilings)
    if r.precision == "fp8":
        catalog = [tiles for tiles in catalog if tiles.kv_tokens >= FP8_MIN_KV_TOKENS]
        if not catalog:
            raise ValueError(f"shape={r.shape} is too small for FP8's tiles (KV tiles of {FP8_MIN_KV_TOKENS} tokens or "
                             "more); plan it with precision=None.")
    if r.window is not None:
        windows, band = (r.window,), None
    else:
        found = candidate_windows(r.shape, r.target, r.causal, catalog)
        windows, band = found.windows, found.band

    # Every row meets the target: a window admissible at stride 1 attends no more keys at larger strides.
    rows, keys = _sweep_windows(r, windows, catalog)
    scorer = _Scorer(r.shape, catalog, r.cost_model, r.heads or 1, r.head_dim, element_bytes(r.dtype), r.precision)
    call = dict(batch_heads=r.heads or 1, head_dim=r.head_dim, element_bytes=element_bytes(r.dtype))
    priced: dict[str, tuple[np.ndarray, Optional[np.ndarray]]] = {}  # backend: (scores, their backward parts)
    if "triton" in r.backends.priced:
        scores = scorer.score(rows["tile_index"], rows["visited_tiles"], rows["full_tiles"])
        backward = None
        if r.training:
            problems = [Problem(r.shape, windows[w], stride, causal=r.causal) for w, stride in keys]
            backward = backward_scores(problems, r.cost_model, **call)[rows["key_index"]]
            scores = scores + backward
        priced["triton"] = scores, backward
    fa4 = None
    if "fa4" in r.backends.priced:
        fa4 = Fa4Scorer(r.shape, r.causal, windows, catalog, r.cost_model, dtype=r.dtype, training=r.training, **call)
        priced["fa4"] = fa4.scores(rows)
    gluon = None
    if "gluon" in r.backends.priced:
        gluon = GluonScorer(r.shape, r.causal, windows, catalog, r.cost_model, dtype=r.dtype,
                            batch_heads=call["batch_heads"], head_dim=r.head_dim, element_bytes=call["element_bytes"])
        priced["gluon"] = gluon.scores(rows)
    if r.cost_model is not None:  # a call takes at least its backend's host time (planner.cost.host)
        priced = {b: (r.cost_model.at_least_host(s, b), backward) for b, (s, backward) in priced.items()}
    products = rows["stride"].prod(axis=1)
    allowed = r.backends.allowed
    scores, backend_of = _best_backend(priced, allowed)
    if not np.isfinite(scores).any():
        raise ValueError(
            f"no configuration of shape={r.shape} runs on {' or '.join(NAMES[b] for b in allowed)} at "
            f"head_dim={r.head_dim}{' with its backward pass' if r.training else ''}; for the catalog's first tiles: "
            f"{fa4_gna_refusal(catalog[0], r.head_dim, r.dtype, r.training)}"
        )
    chosen = choose(scores, products)
    n = math.prod(r.shape)

    def candidate(row: int, backend: str) -> Candidate:
        tiles = catalog[int(rows["tile_index"][row])]
        score, backward = priced[backend]
        return Candidate(
            window=windows[int(rows["window_index"][row])],
            stride=tuple(int(s) for s in rows["stride"][row]),
            q_tile=tiles.q_tile,
            kv_tile=tiles.kv_tile,
            score=float(score[row]),
            sparsity=1.0 - float(rows["attended_pairs"][row]) / (n * n),
            tile_speedup=float(rows["num_kv_tiles"][row] / rows["max_kv_tiles"][row]),
            block_sparse=bool(rows["full_tiles"][row] == rows["visited_tiles"][row]),
            kv_tiling=tiles.kv_tiling,
            backward_score=float(backward[row]) if r.training else None,
            backend=backend,
        )

    def ranked(row: int) -> Candidate:
        return candidate(row, allowed[backend_of[row]])

    winner = ranked(chosen)
    breakdown = {}
    if winner.backend == "fa4":
        breakdown = fa4.breakdown(rows, chosen)
    elif winner.backend == "gluon":
        breakdown = gluon.breakdown(rows, chosen)
    elif r.cost_model is not None:
        picked = [chosen]
        breakdown = r.cost_model.breakdown(
            scorer.features(rows["tile_index"][picked], rows["visited_tiles"][picked], rows["full_tiles"][picked])[0],
            r.precision,
        )
        if r.training:
            breakdown.update(backward_breakdown(Problem(r.shape, winner.window, winner.stride, causal=r.causal),
                                                r.cost_model, **call))
    dense = Problem(r.shape, r.shape)
    dense_backward = backward_score(dense, r.cost_model, **call) if r.training else None
    best_by_backend = tuple(candidate(choose(priced[b][0], products), b) for b in r.backends.priced
                            if np.isfinite(priced[b][0]).any())
    would_pick = None
    if r.backends.priced != allowed:
        everywhere, everywhere_backend = _best_backend(priced, r.backends.priced)
        row = choose(everywhere, products)
        would_pick = candidate(row, r.backends.priced[everywhere_backend[row]])
    return Plan(
        problem=Problem(r.shape, winner.window, winner.stride, causal=r.causal),
        tiles=TileConfig(winner.q_tile, winner.kv_tile, kv_tiling=winner.kv_tiling),
        target_sparsity=r.target,
        head_dim=r.head_dim,
        dtype=dtype_name(r.dtype),
        heads=r.heads,
        gpu=r.gpu,
        basis=BASIS_COST_MODEL if r.cost_model is not None else BASIS_TILES,
        score=winner.score,
        dense_score=(scorer.dense_score() if r.cost_model is None
                     else float(r.cost_model.at_least_host(scorer.dense_score(), "triton"))) + (dense_backward or 0.0),
        breakdown=breakdown,
        runners_up=tuple(ranked(row) for row in _runner_up_rows(rows, scores, chosen)),
        search=Search(
            windows=tuple(windows),
            window_given=band is None,
            band=band,
            scored=int(sum(np.isfinite(priced[b][0]).sum() for b in allowed)),
            top=tuple(ranked(int(row)) for row in _best_rows(scores, TOP)),
            tie_tolerance=TIE_TOLERANCE,
            kv_tilings=r.kv_tilings,
            kv_tiling_fixed=r.kv_tiling_fixed,
            backends=allowed,
            best_by_backend=best_by_backend,
            would_pick=would_pick,
            backend_notes=r.backends.notes,
        ),
        training=r.training,
        backward_score=winner.backward_score,
        dense_backward_score=dense_backward,
        precision=r.precision,
        backend=winner.backend,
    )


def _auto_precision(shape, target_sparsity, *, training: bool, world_size: Optional[int], kv_tiling: Optional[str],
                    backends: BackendsLike, **options) -> Plan:
    """`best(..., precision="auto")`: the bf16 plan, or the FP8 plan where both are priced and FP8's is predicted
    faster by more than TIE_TOLERANCE (module docstring); the plan's search records both, or why FP8 was not
    priced."""
    if training or world_size is not None:
        raise ValueError(f"precision='auto' chooses between bf16 and FP8 for inference on one GPU, so training must "
                         f"be False and world_size None, got {training=}, {world_size=}; pass precision=None.")
    names = check_backends(backends)
    bf16 = best(shape, target_sparsity, kv_tiling=kv_tiling, backends=_of(names, ("triton", "fa4")), **options)
    try:
        fp8 = best(shape, target_sparsity, kv_tiling=kv_tiling, precision="fp8",
                   backends=_of(names, ("triton", "gluon")), **options)
    except ValueError as error:  # kv_tiling="dynamic", a layout too small for FP8's tiles, backends without one
        return _with_precisions(bf16, bf16, None, f"FP8 was not planned: {error}")
    if not (bf16.calibrated and fp8.calibrated):
        return _with_precisions(bf16, bf16, fp8, "FP8 was not picked: without a cost model for both precisions "
                                                 "their times cannot be compared, and bf16 is the more accurate")
    faster = fp8.score < bf16.score * (1.0 - TIE_TOLERANCE)
    note = (f"FP8 is predicted {bf16.score / fp8.score:.2f}x faster than bf16 (more than the {TIE_TOLERANCE:.0%} "
            "tie tolerance), so the plan runs in FP8" if faster else
            f"FP8 is not predicted faster than bf16 by more than {TIE_TOLERANCE:.0%} ({bf16.score / fp8.score:.2f}x), "
            "so the plan keeps bf16, the more accurate")
    return _with_precisions(fp8 if faster else bf16, bf16, fp8, note)


def _of(names: Optional[tuple[str, ...]], usable: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    """The backends asked for (None: every one) that a precision's search may use; a sentence error by `best`
    where none is left."""
    return None if names is None else tuple(name for name in names if name in usable) or names


def _with_precisions(plan: Plan, bf16: Plan, fp8: Optional[Plan], note: str) -> Plan:
    """`plan` with each precision's best (precision, backend, predicted seconds) and the reason in its search."""
    scores = [("bf16", bf16.backend, float(bf16.score))]
    if fp8 is not None:
        scores.append(("fp8", fp8.backend, float(fp8.score)))
    return replace(plan, search=replace(plan.search, precisions=tuple(scores), precision_note=note))


def _best_backend(priced: dict[str, tuple[np.ndarray, Optional[np.ndarray]]],
                  backends: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best score among `backends` and the index in `backends` of the backend that has it (the first on
    a tie): ranking rows by it under the tie rule ranks (configuration, backend) pairs, since a row's backends
    share its stride product."""
    table = np.stack([priced[b][0] for b in backends])
    best = np.argmin(table, axis=0)
    return table[best, np.arange(table.shape[1])], best


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
    device: DeviceLike = None,
    cost_model: Optional[CostModelLike] = None,
    training: bool = False,
    world_size: Optional[int] = None,
    kv_tiling: Optional[str] = None,
    precision: Optional[str] = None,
    backends: BackendsLike = None,
) -> Union[Plan, ParallelPlan]:
    """The fastest GNA configuration of `shape` whose sparsity is at least `target_sparsity`.

    `heads` (batch 1) scales the predicted time (None: one head); `head_dim` (a multiple of 8 from 16 to 256) and
    `dtype` (bf16, fp16: what the kernel runs) select the tile catalog; `causal` applies per dimension; `window` fixes
    the window (it must meet the target); `max_stride` caps the stride per dimension; `kv_tiling` ("static", "dynamic")
    fixes the KV tiling mode (None: every mode the cost model was calibrated on, both without one).

    `device` picks the GPU whose stored coefficients rank the configurations: a GPU's name or alias ("h100",
    "h200"; refused when it has no coefficients here) or a torch device (None: the current CUDA device; without
    coefficients for it the plan ranks by simulated tile work and says so, in `plan.basis` and
    `plan.explain()`). `cost_model` (a CostModel, or the path of a coefficients file) replaces the stored ones.
    `training` ranks by forward + backward time (the backward's own coefficients; without them, forward +
    backward tile work). `world_size=P`: a `ParallelPlan` for P ranks sharding frames
    (planner.search.parallel), which knows its strategy and split (with `training`, priced forward + backward).
    `precision="fp8"` plans the FP8 inference kernel (module docstring); the plan runs in FP8. `precision="auto"`
    plans both and keeps FP8 only where it is predicted faster by more than the tie tolerance (inference, one GPU).
    `backends` names the kernel backends the plan may run on ("triton", "fa4", "gluon"; planner.backends): None
    means every one available here, natsim's Triton kernels, FlashAttention-4 where it is installed, runs on the
    device (a torch device, or the current CUDA device) and the cost model has its coefficients (with `training`,
    its backward's too), and with `precision="fp8"` natsim's Gluon FP8 kernel on Hopper where it is priced; a
    backend asked for that cannot run here or cannot be priced is refused with a sentence. The plan records its
    backend and runs on it.

    >>> plan = best((30, 48, 80), 0.9, heads=24)   # doctest: +SKIP
    >>> out = plan(q, k, v)                        # doctest: +SKIP
    """
    if precision not in (None, "fp8", AUTO):
        raise ValueError(f"precision must be None (the inputs' dtype), 'fp8' or 'auto' (FP8 where it is predicted "
                         f"faster), got precision={precision!r}.")
    if precision == AUTO:
        return _auto_precision(shape, target_sparsity, heads=heads, head_dim=head_dim, dtype=dtype, causal=causal,
                               window=window, max_stride=max_stride, device=device, cost_model=cost_model,
                               training=training, world_size=world_size, kv_tiling=kv_tiling, backends=backends)
    request = _normalise(shape, target_sparsity, heads, head_dim, dtype, causal, window, max_stride, device,
                         cost_model, training, world_size, kv_tiling, precision, backends)
    plan = _search(request)
    if world_size is None:
        return plan
    world_size = int(world_size)  # checked by _normalise; numpy's integers become ints
    halo = None if halo_runs(plan) else _halo_request(request)
    return parallel_plan(plan, world_size, halo_plan=None if halo is None else _search(halo),
                         link=link_for(request.gpu or "cpu", world_size))  # no GPU: the CPUs' (gloo) link


def _halo_request(request: _Request) -> Optional[_Request]:
    """The search for the best configuration the halo strategy runs: static KV tiling, and to train, stride 1
    along the frames (no causal window there); None where it runs none of this request's."""
    if "static" not in request.kv_tilings or (request.training and request.causal[0]):
        return None
    halo = replace(request, kv_tilings=("static",), kv_tiling_fixed="halo")
    if request.training:
        caps = request.max_stride or request.shape
        halo = replace(halo, max_stride=(1, *caps[1:]))
    return halo
