"""Exact tile counts under 1-D tiling, by interval arithmetic (gna-semantics.md, section 2).

1-D tiles are runs of row-major tokens, so counts do not factorise over dimensions. Instead of an
N x N mask, the keys a Q tile attends are walked as rows along the last dimension: for each run of
queries that share their leading coordinates, a prefix sum over last-dimension key coordinates gives
the attended pairs between any key row and any KV tile in O(1). Summing those per KV tile gives the
visited tiles and, compared with (real queries x real keys), the full ones. Memory is O(number of KV
tiles + last dimension).
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
    """Visited and full KV tiles per Q tile; with `collect`, also write the visited tiles (CSR).

    The queries of a Q tile are taken in runs that share their first two coordinates (x0, x1), and
    so share the rows (y0, y1) of keys they attend. For a run, `cover[y]` counts the run's queries
    whose last-dimension window holds key coordinate y; its prefix sums give, for any row and any KV
    tile, the attended pairs in their intersection in O(1).
    """
    l0, l1, l2 = lengths[0], lengths[1], lengths[2]
    d0, d1, d2 = dilations[0], dilations[1], dilations[2]
    n = l0 * l1 * l2
    nq = _ceil_div(n, q_tile)
    nkv = _ceil_div(n, kv_tile)
    visited = np.zeros(nq, np.int64)
    full = np.zeros(nq, np.int64)
    pairs = np.zeros(nkv, np.int64)  # attended pairs per KV tile for the current Q tile
    cover = np.zeros(l2 + d2, np.int64)
    prefix = np.zeros(l2 + 1, np.int64)
    for qt in range(nq):
        q_begin = qt * q_tile
        q_end = min(q_begin + q_tile, n)
        num_touched, lo_tile, hi_tile = 0, nkv, -1
        q = q_begin
        while q < q_end:
            x0 = q // (l1 * l2)
            x1 = (q // l2) % l1
            run_begin = q % l2
            run_end = min(q_end - q + run_begin, l2)
            # cover[] over last-dimension key coordinates, via a difference array with step d2.
            cover[:] = 0
            lo_key, hi_key = l2, -1
            for x2 in range(run_begin, run_end):
                g = x2 % d2
                first = g + d2 * starts[2, x2]
                last = g + d2 * (ends[2, x2] - 1)
                cover[first] += 1
                cover[last + d2] -= 1
                lo_key = min(lo_key, first)
                hi_key = max(hi_key, last)
            for y in range(d2, l2):
                cover[y] += cover[y - d2]
            for y in range(l2):
                prefix[y + 1] = prefix[y] + cover[y]
            for k0 in range(starts[0, x0], ends[0, x0]):
                y0 = x0 % d0 + d0 * k0
                for k1 in range(starts[1, x1], ends[1, x1]):
                    y1 = x1 % d1 + d1 * k1
                    base = (y0 * l1 + y1) * l2
                    for t in range((base + lo_key) // kv_tile, (base + hi_key) // kv_tile + 1):
                        lo = max(t * kv_tile - base, lo_key)
                        hi = min((t + 1) * kv_tile - base, hi_key + 1)
                        count = prefix[hi] - prefix[lo]
                        if count > 0:
                            if pairs[t] == 0:
                                num_touched += 1
                                lo_tile, hi_tile = min(lo_tile, t), max(hi_tile, t)
                            pairs[t] += count
            q += run_end - run_begin
        visited[qt] = num_touched
        m = 0
        for t in range(lo_tile, hi_tile + 1):  # the touched tiles in ascending order, without a sort
            if pairs[t] == 0:
                continue
            real_keys = min((t + 1) * kv_tile, n) - t * kv_tile
            is_full = pairs[t] == (q_end - q_begin) * real_keys
            full[qt] += is_full
            if collect:
                indices[offsets[qt] + m] = t
                full_flags[offsets[qt] + m] = is_full
            pairs[t] = 0
            m += 1
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
