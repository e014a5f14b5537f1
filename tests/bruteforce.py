"""A brute-force reference for GNA masks and tile counts, written from shared/design/gna-semantics.md alone.

Nothing here imports natsim's internals: the window formula, the dilation groups, the token permutation and
every tile count are re-derived from the contract, the slow and obvious way (an exact N x N boolean mask,
then scanning it tile by tile). Use it only for small problems (N up to a few thousand tokens).

Inputs are plain per-dimension tuples (or anything with `.shape/.window/.stride/.dilation/.causal`, such as
a `natsim.Problem`), so the reference can check natsim without trusting its normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np


# --------------------------------------------------------------------------------------------------------
# Section 1: the mask


def group_length(L: int, d: int, g: int) -> int:
    """Length of dilation group `g` of a dimension of length `L` with dilation `d`."""
    return L // d + (1 if g < L % d else 0)


def window_1d(i: int, L: int, w: int, s: int, causal: bool) -> tuple[int, int]:
    """[start, end) of the keys attended by in-group coordinate `i` on (in-group) length `L`."""
    left = w // 2
    if not causal:
        leader = min((i // s) * s + s // 2, L - 1)
        start = min(max(leader - left, 0), L - w)
        end = start + w
    else:
        leader = min((i // s) * s + s - 1, L - 1)
        start = max(leader - w + 1, 0)
        end = min(i + 1, L)
    return start, end


def attends_1d(x: int, y: int, L: int, w: int, s: int, d: int, causal: bool) -> bool:
    """Does a query at coordinate `x` attend a key at coordinate `y` along one dimension?"""
    if x % d != y % d:
        return False
    g = x % d
    start, end = window_1d(x // d, group_length(L, d, g), w, s, causal)
    return start <= y // d < end


def dim_mask(L: int, w: int, s: int, d: int, causal: bool) -> np.ndarray:
    """The `[L, L]` boolean matrix of `attends_1d(x, y)` for one dimension (every pair checked)."""
    x = np.arange(L)
    starts = np.empty(L, np.int64)
    ends = np.empty(L, np.int64)
    for q in range(L):
        starts[q], ends[q] = window_1d(q // d, group_length(L, d, q % d), w, s, causal)
    same_group = (x[:, None] % d) == (x[None, :] % d)
    y_in_group = (x // d)[None, :]
    return same_group & (starts[:, None] <= y_in_group) & (y_in_group < ends[:, None])


@dataclass(frozen=True)
class Params:
    shape: tuple[int, ...]
    window: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    causal: tuple[bool, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.shape)


def params(problem) -> Params:
    """Per-dimension tuples of a problem-like object (scalars broadcast)."""
    shape = tuple(int(v) for v in np.atleast_1d(problem.shape))
    n = len(shape)

    def per_dim(v, cast):
        v = list(np.atleast_1d(v))
        if len(v) == 1:
            v = v * n
        assert len(v) == n
        return tuple(cast(x) for x in v)

    return Params(
        shape,
        per_dim(problem.window, int),
        per_dim(problem.stride, int),
        per_dim(problem.dilation, int),
        per_dim(problem.causal, bool),
    )


def coordinates(shape: Sequence[int]) -> np.ndarray:
    """`[N, ndim]` coordinates of the tokens in row-major order (last dimension fastest)."""
    return np.indices(tuple(shape)).reshape(len(shape), -1).T


def attention_mask(problem) -> np.ndarray:
    """The exact `[N, N]` boolean mask: query x attends key y iff every dimension says so."""
    p = params(problem)
    coords = coordinates(p.shape)
    mask = np.ones((p.num_tokens, p.num_tokens), dtype=bool)
    for j in range(p.ndim):
        m = dim_mask(p.shape[j], p.window[j], p.stride[j], p.dilation[j], p.causal[j])
        mask &= m[coords[:, j][:, None], coords[:, j][None, :]]
    return mask


# --------------------------------------------------------------------------------------------------------
# Section 2: tiles


def tiles_per_group(L: int, T: int, d: int) -> int:
    """Tiles per dilation group along one dimension: each group is padded to ceil(L / (T d)) * T."""
    return -(-L // (T * d))


def multi_d_layout(problem, tile: Sequence[int]) -> tuple[np.ndarray, int, int]:
    """Where every token lands in the permuted, padded layout of multi-D tiles.

    Returns `(tile_of, slot_of, num_tiles)`: the tile index and the slot (tile index * tokens per tile +
    row-major position inside the tile) of every token (row-major token order), and the number of tiles.
    Tiles are numbered dilation groups first (row-major over dimensions), then tiles row-major inside
    a group.
    """
    p = params(problem)
    tile = tuple(tile)
    assert len(tile) == p.ndim
    coords = coordinates(p.shape)
    g = coords % np.array(p.dilation)
    in_group = coords // np.array(p.dilation)
    t = in_group // np.array(tile)
    pos = in_group % np.array(tile)
    tpg = [tiles_per_group(L, T, d) for L, T, d in zip(p.shape, tile, p.dilation)]
    grid = tuple(p.dilation) + tuple(tpg)
    tile_of = np.ravel_multi_index(tuple(g.T) + tuple(t.T), grid) if p.num_tokens else np.zeros(0, int)
    slot_in_tile = np.ravel_multi_index(tuple(pos.T), tile)
    return tile_of, tile_of * math.prod(tile) + slot_in_tile, math.prod(grid)


def one_d_layout(problem, tile: int) -> tuple[np.ndarray, int]:
    n = params(problem).num_tokens
    return np.arange(n) // tile, -(-n // tile)


def _one_hot(index: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros((size, len(index)))
    out[index, np.arange(len(index))] = 1.0
    return out


def static_counts(mask: np.ndarray, q_tile_of, num_q, kv_tile_of, num_kv):
    """Scan the mask block by block: `(visited, full)` boolean `[num_q, num_kv]` matrices.

    A (Q tile, KV tile) pair is visited iff some real query of the Q tile attends some real key of the
    KV tile, and full iff every (real query, real key) pair in it is attended.
    """
    A = _one_hot(q_tile_of, num_q)
    B = _one_hot(kv_tile_of, num_kv)
    attended = A @ mask.astype(np.float64) @ B.T  # attended pairs per block (exact in float64 here)
    pairs = A.sum(1)[:, None] * B.sum(1)[None, :]
    visited = attended > 0
    full = visited & (attended == pairs)
    return visited, full


def dynamic_counts(problem, mask: np.ndarray, q_tile: Sequence[int], kv_tile: Sequence[int]):
    """Per-Q-tile `(visited, full, regions)` under dynamic KV tiling (multi-D), from the mask.

    For each Q tile, the KV region along every dimension is the span (in in-group coordinates) of the
    keys its real queries attend; it is cut into KV tiles starting at the region's start; keys past the
    group's length are padding. A dynamic tile is visited iff it holds an attended key, and full iff every
    (real query, real key) pair in it is attended. `regions[q]` is the per-dimension (lo, hi) or None.
    """
    p = params(problem)
    coords = coordinates(p.shape)
    dil = np.array(p.dilation)
    group = coords % dil
    in_group = coords // dil
    q_tile_of, _, num_q = multi_d_layout(problem, q_tile)
    visited = np.zeros(num_q, np.int64)
    full = np.zeros(num_q, np.int64)
    regions: list[Optional[tuple]] = [None] * num_q
    T = np.array(kv_tile)
    for qt in range(num_q):
        queries = np.nonzero(q_tile_of == qt)[0]
        if len(queries) == 0:
            continue
        sub = mask[queries]
        keys = sub.any(axis=0)
        if not keys.any():  # cannot happen (every query attends itself or its window), but be safe
            continue
        g = group[queries[0]]
        assert (group[queries] == g).all(), "a Q tile mixes dilation groups"
        lo = in_group[keys].min(axis=0)
        hi = in_group[keys].max(axis=0) + 1
        regions[qt] = tuple(zip(lo.tolist(), hi.tolist()))
        n_tiles = -(-(hi - lo) // T)
        in_region = (
            (group == g).all(axis=1)
            & (in_group >= lo).all(axis=1)
            & (in_group < lo + n_tiles * T).all(axis=1)
        )
        cand = np.nonzero(in_region)[0]
        kv_of = np.ravel_multi_index(tuple(((in_group[cand] - lo) // T).T), tuple(n_tiles))
        num_kv = int(np.prod(n_tiles))
        attended = np.bincount(kv_of, weights=sub[:, cand].sum(axis=0), minlength=num_kv)
        real_keys = np.bincount(kv_of, minlength=num_kv)
        v = attended > 0
        visited[qt] = v.sum()
        full[qt] = (v & (attended == real_keys * len(queries))).sum()
    return visited, full, regions


# --------------------------------------------------------------------------------------------------------
# Section 3: figures


@dataclass
class Reference:
    num_tokens: int
    attended_pairs: int
    sparsity: Fraction
    flop_speedup: Fraction
    visited_tiles: int
    full_tiles: int
    max_kv_tiles: int
    dense_tiles: int
    tile_speedup: Fraction
    tile_speedup_mean: Fraction
    block_sparse: bool
    num_q_tiles: int  # dense reference nQ
    num_kv_tiles: int  # dense reference nKV
    per_q_tile_visited: np.ndarray
    per_q_tile_full: np.ndarray
    visited_matrix: Optional[np.ndarray] = None  # static KV tiling only: [Q tiles, KV tiles] booleans
    full_matrix: Optional[np.ndarray] = None


def _per_dim_tile(tile, ndim: int) -> tuple[int, ...]:
    tile = tuple(int(v) for v in np.atleast_1d(tile))
    return tile * ndim if len(tile) == 1 else tile


def reference(problem, q_tile, kv_tile, tiling: str = "multi", kv_tiling: str = "static",
              mask: Optional[np.ndarray] = None) -> Reference:
    """Every figure of gna-semantics.md section 3, by brute force."""
    p = params(problem)
    n = p.num_tokens
    if mask is None:
        mask = attention_mask(p)
    attended = int(mask.sum())
    vm = fm = None
    if tiling == "1d":
        assert kv_tiling == "static"
        tq, tkv = int(np.atleast_1d(q_tile)[0]), int(np.atleast_1d(kv_tile)[0])
        q_of, nq = one_d_layout(p, tq)
        k_of, nk = one_d_layout(p, tkv)
        vm, fm = static_counts(mask, q_of, nq, k_of, nk)
        per_v, per_f = vm.sum(1), fm.sum(1)
        dense_q, dense_kv = nq, nk
    else:
        tq = _per_dim_tile(q_tile, p.ndim)
        tkv = _per_dim_tile(kv_tile, p.ndim)
        dense_q = math.prod(-(-L // t) for L, t in zip(p.shape, tq))
        dense_kv = math.prod(-(-L // t) for L, t in zip(p.shape, tkv))
        if kv_tiling == "static":
            q_of, _, nq = multi_d_layout(p, tq)
            k_of, _, nk = multi_d_layout(p, tkv)
            vm, fm = static_counts(mask, q_of, nq, k_of, nk)
            per_v, per_f = vm.sum(1), fm.sum(1)
        else:
            per_v, per_f, _ = dynamic_counts(p, mask, tq, tkv)
    visited, full, most = int(per_v.sum()), int(per_f.sum()), int(per_v.max())
    return Reference(
        num_tokens=n,
        attended_pairs=attended,
        sparsity=1 - Fraction(attended, n * n),
        flop_speedup=Fraction(n * n, attended),
        visited_tiles=visited,
        full_tiles=full,
        max_kv_tiles=most,
        dense_tiles=dense_q * dense_kv,
        tile_speedup=Fraction(dense_kv, most),
        tile_speedup_mean=Fraction(dense_q * dense_kv, visited),
        block_sparse=full == visited,
        num_q_tiles=dense_q,
        num_kv_tiles=dense_kv,
        per_q_tile_visited=np.asarray(per_v, np.int64),
        per_q_tile_full=np.asarray(per_f, np.int64),
        visited_matrix=vm,
        full_matrix=fm,
    )


# --------------------------------------------------------------------------------------------------------
# Closed forms of section 2, for checking this reference itself (the mask scan must agree with them)


def formula_counts(problem, q_tile, kv_tile, kv_tiling: str = "static"):
    """Per-Q-tile visited counts from the per-dimension formulas of section 2 (multi-D tiling only).

    Q tiles are numbered as in `multi_d_layout`; a Q tile with no real query visits nothing.
    """
    p = params(problem)
    tq = _per_dim_tile(q_tile, p.ndim)
    tkv = _per_dim_tile(kv_tile, p.ndim)
    tpg = [tiles_per_group(L, T, d) for L, T, d in zip(p.shape, tq, p.dilation)]
    grid = tuple(p.dilation) + tuple(tpg)
    out = np.zeros(math.prod(grid), np.int64)
    for index in range(len(out)):
        gt = np.unravel_index(index, grid)
        count = 1
        for j in range(p.ndim):
            g, t = int(gt[j]), int(gt[p.ndim + j])
            Lg = group_length(p.shape[j], p.dilation[j], g)
            first, last = t * tq[j], min((t + 1) * tq[j], Lg) - 1
            if last < first:
                count = 0
                break
            args = (Lg, p.window[j], p.stride[j], p.causal[j])
            start, end = window_1d(first, *args)[0], window_1d(last, *args)[1]
            if kv_tiling == "static":
                count *= -(-end // tkv[j]) - start // tkv[j]
            else:
                count *= -(-(end - start) // tkv[j])
        out[index] = count
    return out


# --------------------------------------------------------------------------------------------------------
# Hypothesis strategies: small problems and tiles that hit the edge cases often

from hypothesis import strategies as st  # noqa: E402

MAX_LEN = {1: 600, 2: 24, 3: 8}


def _mixed(special: Sequence[int], lo: int, hi: int):
    """Mostly special values (edge cases), otherwise any int in [lo, hi]."""
    special = sorted({v for v in special if lo <= v <= hi})
    if not special:
        return st.integers(lo, hi)
    return st.one_of(st.sampled_from(special), st.integers(lo, hi))


@st.composite
def dims_params(draw, L: int):
    """(window, stride, dilation, causal) for one dimension of length L."""
    d = draw(st.one_of(st.just(1), _mixed([2, 3], 1, min(L, 5))))
    wmax = L // d
    w = draw(_mixed([1, 2, 3, 4, 8, wmax, wmax - 1], 1, wmax))
    s = draw(_mixed([1, w, w - 1, 2], 1, w))
    c = draw(st.booleans())
    return w, s, d, c


@st.composite
def problems(draw, ndim: Optional[int] = None, max_tokens: int = 600):
    """A natsim.Problem with at most `max_tokens` tokens."""
    from natsim import Problem

    n = draw(st.sampled_from([1, 2, 3])) if ndim is None else ndim
    shape = []
    for j in range(n):
        room = max(1, max_tokens // max(1, math.prod(shape)) // (2 ** (n - 1 - j)))
        hi = min(MAX_LEN[n], room)
        shape.append(draw(_mixed([1, 2, 3, 4, 7, 8, 9, 16, 17, hi], 1, hi)))
    per_dim = [draw(dims_params(L)) for L in shape]
    w, s, d, c = (tuple(v) for v in zip(*per_dim))
    # now and then pass scalars, which must broadcast
    if n > 1 and len(set(w)) == 1 and draw(st.booleans()):
        w = w[0]
    if len(set(s)) == 1 and draw(st.booleans()):
        s = s[0]
    if len(set(d)) == 1 and draw(st.booleans()):
        d = d[0]
    if len(set(c)) == 1 and draw(st.booleans()):
        c = c[0]
    return Problem(tuple(shape), w, s, d, c)


def tile_sizes(L: int):
    return _mixed([1, 2, 3, 4, 8, 16, L, L + 1, 2 * L], 1, L + 3)


@st.composite
def multi_tiles(draw, problem, kv_tiling=None):
    """A multi-D TileConfig for `problem` (sometimes a scalar that broadcasts)."""
    from natsim import TileConfig

    kv_tiling = draw(st.sampled_from(["static", "dynamic"])) if kv_tiling is None else kv_tiling
    tiles = []
    for _ in range(2):
        t = tuple(draw(tile_sizes(L)) for L in problem.shape)
        if problem.ndim > 1 and draw(st.integers(0, 4)) == 0:
            t = draw(_mixed([1, 2, 4], 1, max(problem.shape) + 1))
        tiles.append(t)
    return TileConfig(tiles[0], tiles[1], tiling="multi", kv_tiling=kv_tiling)


@st.composite
def one_d_tiles(draw, problem):
    from natsim import TileConfig

    n = problem.num_tokens
    special = [1, 2, 3, 8, 16, 64, 128, n, n + 1] + list(problem.shape)
    return TileConfig(draw(_mixed(special, 1, n + 2)), draw(_mixed(special, 1, n + 2)), tiling="1d")
