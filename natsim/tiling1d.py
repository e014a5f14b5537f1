"""Exact tile counts under 1-D tiling, by interval arithmetic (gna-semantics.md, section 2).

1-D tiles are runs of row-major tokens, so counts do not factorise over dimensions. Instead of an
N x N mask, each query's window is walked as rows along the last dimension: a row is an arithmetic
progression of flattened key indices, and the number of its keys in each KV tile follows from two
ceiling divisions. Summing those per KV tile over the queries of a Q tile gives the visited tiles and,
by comparing with (real queries x real keys), the full ones. Memory is O(number of KV tiles).
"""

from __future__ import annotations

import numba
import numpy as np

from .dimension import key_ranges
from .problem import Problem


@numba.njit(cache=True)
def _ceil_div(a, b):
    return -((-a) // b)


@numba.njit(cache=True)
def _count(lengths, dilations, starts, ends, q_tile, kv_tile, collect, offsets, indices, full_flags):
    """Visited and full KV tiles per Q tile; with `collect`, also write the visited tiles (CSR)."""
    l0, l1, l2 = lengths[0], lengths[1], lengths[2]
    d0, d1, d2 = dilations[0], dilations[1], dilations[2]
    n = l0 * l1 * l2
    nq = _ceil_div(n, q_tile)
    nkv = _ceil_div(n, kv_tile)
    visited = np.zeros(nq, np.int64)
    full = np.zeros(nq, np.int64)
    pairs = np.zeros(nkv, np.int64)  # attended pairs per KV tile for the current Q tile
    touched = np.empty(nkv, np.int64)
    for qt in range(nq):
        q_begin = qt * q_tile
        q_end = min(q_begin + q_tile, n)
        num_touched = 0
        for q in range(q_begin, q_end):
            x0 = q // (l1 * l2)
            x1 = (q // l2) % l1
            x2 = q % l2
            a, b = starts[2, x2], ends[2, x2]
            for k0 in range(starts[0, x0], ends[0, x0]):
                y0 = x0 % d0 + d0 * k0
                for k1 in range(starts[1, x1], ends[1, x1]):
                    y1 = x1 % d1 + d1 * k1
                    base = (y0 * l1 + y1) * l2 + x2 % d2  # key index = base + d2 * k, k in [a, b)
                    first_tile = (base + d2 * a) // kv_tile
                    last_tile = (base + d2 * (b - 1)) // kv_tile
                    for t in range(first_tile, last_tile + 1):
                        k_lo = max(a, _ceil_div(t * kv_tile - base, d2))
                        k_hi = min(b, _ceil_div((t + 1) * kv_tile - base, d2))
                        if k_hi > k_lo:
                            if pairs[t] == 0:
                                touched[num_touched] = t
                                num_touched += 1
                            pairs[t] += k_hi - k_lo
        tiles = np.sort(touched[:num_touched])
        visited[qt] = num_touched
        for m in range(num_touched):
            t = tiles[m]
            real_keys = min((t + 1) * kv_tile, n) - t * kv_tile
            is_full = pairs[t] == (q_end - q_begin) * real_keys
            full[qt] += is_full
            if collect:
                indices[offsets[qt] + m] = t
                full_flags[offsets[qt] + m] = is_full
            pairs[t] = 0
    return visited, full


def _prepare(problem: Problem):
    pad = 3 - problem.ndim
    dims = [(1, 1, 1, 1, False)] * pad + list(
        zip(problem.shape, problem.window, problem.stride, problem.dilation, problem.causal)
    )
    longest = max(d[0] for d in dims)
    starts = np.zeros((3, longest), np.int64)
    ends = np.zeros((3, longest), np.int64)
    for axis, dim in enumerate(dims):
        start, end = key_ranges(*dim)
        starts[axis, : dim[0]] = start
        ends[axis, : dim[0]] = end
    lengths = np.array([d[0] for d in dims], np.int64)
    dilations = np.array([d[3] for d in dims], np.int64)
    return lengths, dilations, starts, ends


def count_1d(problem: Problem, q_tile: int, kv_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-Q-tile (visited, full) KV tile counts under 1-D tiling with static KV tiles."""
    lengths, dilations, starts, ends = _prepare(problem)
    empty_i, empty_b = np.zeros(1, np.int64), np.zeros(1, np.bool_)
    return _count(lengths, dilations, starts, ends, q_tile, kv_tile, False, empty_i, empty_i, empty_b)


def block_lists_1d(problem: Problem, q_tile: int, kv_tile: int):
    """CSR lists of visited KV tiles under 1-D tiling: (offsets, indices, full flags, visited, full)."""
    lengths, dilations, starts, ends = _prepare(problem)
    visited, full = count_1d(problem, q_tile, kv_tile)
    offsets = np.zeros(len(visited) + 1, np.int64)
    np.cumsum(visited, out=offsets[1:])
    indices = np.zeros(max(int(offsets[-1]), 1), np.int64)
    flags = np.zeros(max(int(offsets[-1]), 1), np.bool_)
    _count(lengths, dilations, starts, ends, q_tile, kv_tile, True, offsets, indices, flags)
    return offsets, indices[: offsets[-1]], flags[: offsets[-1]], visited, full
