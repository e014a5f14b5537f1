"""Query-tile merging (FG-Attn, section 5.2): small Q tiles packed into groups, one per thread block.

A kernel with small query tiles (say 16 queries) still wants 128 queries per thread block, so it runs
`group` Q tiles together, and the group must visit every KV tile that any member visits: the union of
the members' rows. Merging therefore gives back part of the sparsity that small tiles exposed. Which
tiles share a group decides how much:

- `"consecutive"`: tiles 0..R-1, R..2R-1, ... (what a kernel does with no planning).
- `"xor"`: FG-Attn's greedy. The XOR distance of two Q tiles is the number of KV tiles visited by
  exactly one of them. Take the first ungrouped Q tile (the group's representative), add the R-1
  ungrouped tiles nearest to it by XOR distance, and repeat until every tile is grouped. Ties in
  distance go to the lowest Q tile index. This approximately minimises the paper's objective (Eq. 1):
  the sum over groups of the XOR distance of every member to its representative.

Under both methods every group holds `group` tiles except possibly the last, which holds what is left,
and a group's representative is its lowest-numbered tile (the greedy's leader is by construction the
lowest ungrouped tile).

Rows are bit-packed into uint64 words (bit k of word w is KV tile 64 w + k) and the loops are
numba-compiled, with hardware popcount for the distances. The greedy keeps the ungrouped tiles word-major,
so that a leader's distances to a run of candidates are vector popcounts (cheaper lower bounds cannot help:
on a predictor's mask the R-1-th nearest row is nearly as far as any, and no bound short of the distance
itself rules rows out), keeps the R-1 best candidates in a small sorted array instead of sorting, and stops
early once R-1 exact copies of the leader are found.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Literal, Sequence, TypeVar, Union

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from .blockmask import BlockMask

Method = Literal["consecutive", "xor"]
T = TypeVar("T")
R = TypeVar("R")
METHODS = ("consecutive", "xor")


@dataclass(frozen=True)
class MergeResult:
    """Q tiles grouped for one thread block each, the KV tiles each group visits, and the figures.

    Notation: nQ Q tiles and nKV KV tiles in the input mask, groups G_1..G_n (n = `num_groups`), U_g
    the union of the KV tiles visited by the members of G_g, c_g the representative of G_g (its first
    member).

    Fields:
    - `method`, `group`: the arguments of `merge` (`group` is R, the Q tiles per group).
    - `groups`: int64 `[num_groups, group]`; row g lists the Q tiles of G_g in ascending order (so the
      representative comes first), padded with -1 where the last group is short.
    - `group_sizes`: int64 `[num_groups]`, |G_g|: `group` for every group but possibly the last.
    - `merged`: a `BlockMask` whose Q tiles are the groups: row g lists U_g. A KV tile is full there
      when it is full for every member (the kernel can then skip the element mask for the whole
      group); every other tile of U_g is partial. A boolean-array input has no full tiles.
    - `visited_before`: (Q tile, KV tile) pairs visited by the input mask.
    - `objective`: Eq. 1 of the paper, sum over g of sum over i in G_g of d(i, c_g), where d(i, j) is
      the number of KV tiles visited by exactly one of Q tiles i and j.
    """

    method: str
    group: int
    groups: np.ndarray
    group_sizes: np.ndarray
    merged: BlockMask
    visited_before: int
    objective: int

    @property
    def num_q_tiles(self) -> int:
        """nQ, the Q tiles of the input mask."""
        return int(self.group_sizes.sum())

    @property
    def num_kv_tiles(self) -> int:
        """nKV, the KV tiles of the input mask."""
        return self.merged.num_kv_tiles

    @property
    def num_groups(self) -> int:
        """n = ceil(nQ / group), the merged Q tiles (thread blocks)."""
        return len(self.group_sizes)

    @property
    def visited_after(self) -> int:
        """(Q tile, KV tile) pairs computed after merging: sum over g of |U_g| * |G_g|."""
        return int((self.merged.visited * self.group_sizes).sum())

    @property
    def density_before(self) -> float:
        """visited_before / (nQ * nKV): the fraction of Q-tile work the input mask asks for."""
        return self.visited_before / (self.num_q_tiles * self.num_kv_tiles)

    @property
    def density_after(self) -> float:
        """visited_after / (nQ * nKV): the fraction of Q-tile work done once tiles run in groups."""
        return self.visited_after / (self.num_q_tiles * self.num_kv_tiles)

    @property
    def max_kv_tiles(self) -> int:
        """max over g of |U_g|: the KV tiles of the busiest group."""
        return int(self.merged.visited.max())

    @property
    def tile_speedup(self) -> float:
        """nKV / max_kv_tiles: the worst group bounds the speedup over dense attention run in groups.

        Infinite when no group visits any KV tile.
        """
        return self.num_kv_tiles / self.max_kv_tiles if self.max_kv_tiles else math.inf

    @property
    def tile_speedup_mean(self) -> float:
        """(n * nKV) / (sum over g of |U_g|): dense group work over merged group work.

        nKV over the mean union size. It counts a short last group as a whole thread block, so it equals
        1 / density_after exactly when `group` divides nQ. Infinite when no group visits any KV tile.
        """
        unions = int(self.merged.visited.sum())
        return self.num_groups * self.num_kv_tiles / unions if unions else math.inf

    def to_dict(self) -> dict:
        """The arguments and every scalar figure, JSON-ready."""
        return {
            "method": self.method,
            "group": self.group,
            "num_q_tiles": self.num_q_tiles,
            "num_kv_tiles": self.num_kv_tiles,
            "num_groups": self.num_groups,
            "visited_before": self.visited_before,
            "visited_after": self.visited_after,
            "density_before": self.density_before,
            "density_after": self.density_after,
            "objective": self.objective,
            "max_kv_tiles": self.max_kv_tiles,
            "tile_speedup": self.tile_speedup,
            "tile_speedup_mean": self.tile_speedup_mean,
        }


def merge(mask: Union[BlockMask, np.ndarray], group: int, method: Method = "xor") -> MergeResult:
    """Group the Q tiles of `mask` by `group` (R) and report what each group must visit.

    `mask` is a `BlockMask` (its visited tiles, partial and full, are the rows) or a 2-D boolean array
    `[num_q_tiles, num_kv_tiles]`. `method` is `"consecutive"` or `"xor"` (the module docstring defines
    both, including the tie-break). See `MergeResult` for the fields and figures.
    """
    if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(
            f"group must be a positive integer (Q tiles per merged group), got group={group!r}."
        )
    if method not in METHODS:
        raise ValueError(f"method must be 'consecutive' or 'xor', got method={method!r}.")
    group = int(group)
    bits, full_bits, num_kv = _pack(mask)
    num_q = bits.shape[0]
    members = _xor_greedy(bits, group) if method == "xor" else np.arange(num_q, dtype=np.int64)
    union, all_full, objective = _group_stats(bits, full_bits, members, group)

    num_groups = -(-num_q // group)
    padded = np.full(num_groups * group, -1, np.int64)
    padded[:num_q] = members
    sizes = np.full(num_groups, group, np.int64)
    sizes[-1] = num_q - group * (num_groups - 1)
    kv_counts, kv_indices = _unpack(union & ~all_full)
    full_counts, full_indices = _unpack(all_full)
    merged = BlockMask(num_groups, num_kv, kv_counts, kv_indices, full_counts, full_indices)
    return MergeResult(
        method=method,
        group=group,
        groups=padded.reshape(num_groups, group),
        group_sizes=sizes,
        merged=merged,
        visited_before=int(_row_popcounts(bits).sum()),
        objective=int(objective),
    )


def _pack(mask: Union[BlockMask, np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """Bit-pack the visited and the full tiles of `mask`: two uint64 `[nQ, words]` arrays, and nKV."""
    if isinstance(mask, BlockMask):
        num_q, num_kv = mask.num_q_tiles, mask.num_kv_tiles
        _check_size(num_q, num_kv)
        words = -(-num_kv // 64)
        bits = np.zeros((num_q, words), np.uint64)
        full_bits = np.zeros((num_q, words), np.uint64)
        for counts, indices, outs in (
            (mask.kv_num_blocks, mask.kv_indices, (bits,)),
            (mask.full_kv_num_blocks, mask.full_kv_indices, (bits, full_bits)),
        ):
            counts, indices = np.asarray(counts), np.asarray(indices)
            if counts.shape != (num_q,) or indices.ndim != 2 or len(indices) != num_q:
                raise ValueError(
                    "mask is not a valid BlockMask: its count and index arrays must have one row "
                    f"per Q tile, got num_q_tiles={num_q}, counts of shape {counts.shape}, indices "
                    f"of shape {indices.shape}."
                )
            for out in outs:
                bad = _pack_rows(counts, indices, num_kv, out)
                if bad >= 0:
                    raise ValueError(
                        f"mask is not a valid BlockMask: Q tile {bad} lists a KV tile outside "
                        f"0..{num_kv - 1} or more tiles than its index row holds."
                    )
        return bits, full_bits, num_kv
    if not isinstance(mask, np.ndarray):
        raise TypeError(
            "mask must be a natsim.BlockMask or a 2-D boolean numpy array [num_q_tiles, num_kv_tiles], "
            f"got a {type(mask).__name__}."
        )
    if mask.ndim != 2 or mask.dtype != bool:
        raise ValueError(
            "mask must be a 2-D boolean array [num_q_tiles, num_kv_tiles], "
            f"got ndim={mask.ndim}, dtype={mask.dtype}."
        )
    num_q, num_kv = mask.shape
    _check_size(num_q, num_kv)
    bits = pack_rows(mask)
    return bits, np.zeros_like(bits), num_kv


def pack_rows(mask: np.ndarray) -> np.ndarray:
    """Bit-pack boolean rows along the last axis (any leading axes) into uint64 words: bit k of word w is column
    64 w + k, columns past the end are 0."""
    packed = np.packbits(mask, axis=-1, bitorder="little")
    pad = -packed.shape[-1] % 8
    if pad:
        packed = np.pad(packed, [(0, 0)] * (packed.ndim - 1) + [(0, pad)])
    return np.ascontiguousarray(packed).view("<u8").astype(np.uint64, copy=False)


def row_counts(bits: np.ndarray) -> np.ndarray:
    """Set bits per row of packed rows `[..., words]` (int64 `[...]`): the KV tiles each row visits."""
    flat = np.ascontiguousarray(bits).reshape(-1, bits.shape[-1])
    return _row_popcounts(flat).reshape(bits.shape[:-1])


_JOB_WORDS = 1 << 20  # the least work, in word comparisons (about 0.2 ms), worth a job of `merged_counts_many`


def merged_counts(bits: np.ndarray, full_bits: np.ndarray, group: int, method: Method) -> tuple[np.ndarray, np.ndarray]:
    """Per mask of a stack of packed masks `[M, nQ, words]` and per group of `merge(mask, group, method)`: the
    KV tiles of the union of the group's rows and of the intersection of its members' `full_bits` rows, int64
    `[M, groups]` each. These are `merge(...).merged`'s visited and full counts, grouped by the same greedy,
    without building its index rows. A planner asks this for many masks and granularities
    (`merged_counts_many` asks for several at once)."""
    visited, full, _ = merged_counts_many([(bits, full_bits, group, method)])[0]
    return visited, full


def merged_counts_many(
    requests: Sequence[tuple[np.ndarray, np.ndarray, int, Method]],
) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """`merged_counts` of each `(bits, full_bits, group, method)` request, with the seconds its grouping took on
    one core (summed over its masks): `(visited, full, seconds)` per request, in order.

    The masks of an XOR request are grouped one per job (small ones a few per job), a consecutive request (one
    cheap pass) is one job; the jobs run on Python threads, one per core (the compiled loops release the GIL),
    the longest first so that no core is left with a long one at the end, and the counts join in order: the
    same result as one pass. Not numba's own threads: its OpenMP layer would change torch's thread count, which a
    compiled model's guards watch.
    """
    checked = []
    for bits, full_bits, group, method in requests:
        if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)) or group < 1:
            raise ValueError(f"group must be a positive integer (Q tiles per merged group), got group={group!r}.")
        if method not in METHODS:
            raise ValueError(f"method must be 'consecutive' or 'xor', got method={method!r}.")
        if bits.ndim != 3 or full_bits.shape != bits.shape or bits.dtype != np.uint64 or full_bits.dtype != np.uint64:
            raise ValueError("bits and full_bits must be uint64 arrays [masks, Q tiles, words] of one shape, got "
                             f"{bits.dtype} {bits.shape} and {full_bits.dtype} {full_bits.shape}.")
        checked.append((np.ascontiguousarray(bits), np.ascontiguousarray(full_bits), int(group), method == "xor"))

    jobs = []  # (request, first mask, end mask, estimated cost)
    for r, (bits, _, group, xor) in enumerate(checked):
        masks, rows, words = bits.shape
        if xor and masks:  # the greedy compares each leader with the ungrouped rows: about rows^2 / (2 group) distances
            cost = rows * rows * words // (2 * group) + rows * words
            per_job = -(-_JOB_WORDS // cost)  # small masks share a job: a job costs the threads some microseconds
            jobs += [(r, m, min(m + per_job, masks), cost * (min(m + per_job, masks) - m))
                     for m in range(0, masks, per_job)]
        else:
            jobs.append((r, 0, masks, masks * rows * words))

    def run(job: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray, float]:
        bits, full_bits, group, xor = checked[job[0]]
        start = time.perf_counter()
        visited, full = _merged_counts(bits[job[1]:job[2]], full_bits[job[1]:job[2]], group, xor)
        return visited, full, time.perf_counter() - start

    longest_first = sorted(jobs, key=lambda job: -job[3])
    done = dict(zip(longest_first, map_on_cores(run, longest_first)))
    parts = [[] for _ in checked]
    for job in jobs:  # in request and mask order
        parts[job[0]].append(done[job])
    return [(np.concatenate([p[0] for p in mine]), np.concatenate([p[1] for p in mine]), sum(p[2] for p in mine))
            for mine in parts]


def map_on_cores(function: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`[function(item) for item in items]`, the items spread over Python threads, one per core (a single core or
    item runs them here), results in order. It pays where `function` spends its time in compiled code that releases
    the GIL; `function` must not call this itself (its threads would wait on one another)."""
    if len(items) > 1 and (os.cpu_count() or 1) > 1:
        return list(_threads().map(function, items))
    return [function(item) for item in items]


@lru_cache(maxsize=1)
def _threads() -> ThreadPoolExecutor:
    """The threads `map_on_cores` spreads its items over (one per core), made on first use."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="natsim-merge")


def _check_size(num_q: int, num_kv: int) -> None:
    if num_q < 1 or num_kv < 1:
        raise ValueError(
            "mask must have at least one Q tile and one KV tile, "
            f"got num_q_tiles={num_q}, num_kv_tiles={num_kv}."
        )


@intrinsic
def _popcount(typingctx, word):
    """The number of set bits of a uint64, as an int64 (LLVM's ctpop: the popcnt instruction on x86)."""
    if word != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen


@numba.njit(cache=True, nogil=True)
def _row_popcounts(bits):
    """Set bits per row: the KV tiles each packed row visits."""
    counts = np.zeros(bits.shape[0], np.int64)
    for i in range(bits.shape[0]):
        for w in range(bits.shape[1]):
            counts[i] += _popcount(bits[i, w])
    return counts


@numba.njit(cache=True)
def _pack_rows(counts, indices, num_kv, out):
    """OR the listed tiles of each row into `out`; the first malformed row, or -1 if none."""
    one = np.uint64(1)
    for q in range(counts.shape[0]):
        if counts[q] < 0 or counts[q] > indices.shape[1]:
            return q
        for k in range(counts[q]):
            t = indices[q, k]
            if t < 0 or t >= num_kv:
                return q
            out[q, t // 64] |= one << np.uint64(t % 64)
    return -1


_CHUNK = 512  # candidates per distance pass: their distances stay in the L1 cache, and R-1 exact copies of the
# leader among them end its scan
_GONE = 1 << 40  # a grouped tile's distance offset: above every real distance, so never chosen


@numba.njit(cache=True, nogil=True)
def _distances(cols, lead, c0, m, dist):
    """`dist[k] += d(lead, column c0 + k)` for k < m, `cols` holding the packed rows word-major (`[words, tiles]`).

    Word-major, a word of the leader meets a run of candidates at once, which the compiler turns into vector
    popcounts; eight words per pass over the run halve the loads and stores of `dist`."""
    words = cols.shape[0]
    w = 0
    while w + 8 <= words:
        l0, l1, l2, l3 = lead[w], lead[w + 1], lead[w + 2], lead[w + 3]
        l4, l5, l6, l7 = lead[w + 4], lead[w + 5], lead[w + 6], lead[w + 7]
        r0, r1, r2, r3 = cols[w, c0:c0 + m], cols[w + 1, c0:c0 + m], cols[w + 2, c0:c0 + m], cols[w + 3, c0:c0 + m]
        r4, r5, r6, r7 = cols[w + 4, c0:c0 + m], cols[w + 5, c0:c0 + m], cols[w + 6, c0:c0 + m], cols[w + 7, c0:c0 + m]
        for k in range(m):
            low = (_popcount(r0[k] ^ l0) + _popcount(r1[k] ^ l1)) + (_popcount(r2[k] ^ l2) + _popcount(r3[k] ^ l3))
            high = (_popcount(r4[k] ^ l4) + _popcount(r5[k] ^ l5)) + (_popcount(r6[k] ^ l6) + _popcount(r7[k] ^ l7))
            dist[k] += low + high
        w += 8
    while w < words:
        lw = lead[w]
        row = cols[w, c0:c0 + m]
        for k in range(m):
            dist[k] += _popcount(row[k] ^ lw)
        w += 1


@numba.njit(cache=True, nogil=True)
def _xor_greedy(bits, group):
    """FG-Attn's greedy grouping: Q tile indices in group order, `group` at a time.

    The ungrouped tiles sit word-major in `cols`, in ascending tile order, so the leader is the first live column
    and a leader's distances to a run of columns are one vectorised pass (`_distances`); the R-1 nearest are then
    picked from the run in column order, a candidate replacing the R-1-th best only when strictly nearer (ties go
    to the lower tile, as they come first). Grouped columns stay in place, their distances offset by _GONE, until
    they are an eighth of the live range; then the columns are compacted."""
    num_q, words = bits.shape
    order = np.arange(num_q)
    if group == 1:
        return order
    cols = np.empty((words, num_q), np.uint64)
    for i in range(num_q):
        for w in range(words):
            cols[w, i] = bits[i, w]
    index = np.arange(num_q)  # the tile of each column
    gone = np.zeros(num_q, np.int64)  # _GONE for a grouped column, else 0
    keep = np.empty(num_q, np.int64)
    dist = np.empty(_CHUNK, np.int64)
    lead = np.empty(words, np.uint64)
    best_d = np.empty(group - 1, np.int64)  # the R-1 nearest so far, by (distance, column)
    best_c = np.empty(group - 1, np.int64)
    columns, start, dead, done = num_q, 0, 0, 0  # columns in use, first live one, grouped ones from start on
    while done < num_q:
        while gone[start]:
            start += 1
            dead -= 1
        for w in range(words):
            lead[w] = cols[w, start]
        want = min(group - 1, num_q - done - 1)
        found = 0
        limit = _GONE  # a candidate must be nearer than this: the R-1-th best once R-1 are found
        c0 = start + 1
        while want > 0 and c0 < columns and limit > 0:  # limit 0: R-1 exact copies, no later tile does better
            m = min(_CHUNK, columns - c0)
            for k in range(m):
                dist[k] = gone[c0 + k]
            _distances(cols, lead, c0, m, dist)
            for k in range(m):
                d = dist[k]
                if d >= limit:
                    continue
                p = found if found < want else want - 1
                while p > 0 and best_d[p - 1] > d:
                    best_d[p] = best_d[p - 1]
                    best_c[p] = best_c[p - 1]
                    p -= 1
                best_d[p] = d
                best_c[p] = c0 + k
                if found < want:
                    found += 1
                if found == want:
                    limit = best_d[want - 1]
            c0 += m
        order[done] = index[start]
        gone[start] = _GONE
        for k in range(1, want):  # the chosen columns in ascending order (an insertion sort: at most R-1 of them)
            c, p = best_c[k], k
            while p > 0 and best_c[p - 1] > c:
                best_c[p] = best_c[p - 1]
                p -= 1
            best_c[p] = c
        for k in range(want):
            order[done + 1 + k] = index[best_c[k]]
            gone[best_c[k]] = _GONE
        done += want + 1
        dead += want + 1
        if done < num_q and 8 * dead > columns - start:
            kept = 0
            for c in range(start, columns):
                if not gone[c]:
                    keep[kept] = c
                    kept += 1
            for w in range(words):
                for k in range(kept):
                    cols[w, k] = cols[w, keep[k]]
            for k in range(kept):
                index[k] = index[keep[k]]
                gone[k] = 0
            columns, start, dead = kept, 0, 0
    return order


@numba.njit(cache=True)
def _group_stats(bits, full_bits, members, group):
    """Per group (`members` in group order, `group` at a time): the union of the visited rows, the
    intersection of the full rows, and the total XOR distance of members to their representative."""
    num_q, words = bits.shape
    num_groups = (num_q + group - 1) // group
    union = np.empty((num_groups, words), np.uint64)
    all_full = np.empty((num_groups, words), np.uint64)
    objective = 0
    for g in range(num_groups):
        rep = members[g * group]
        for w in range(words):  # element by element: a row assignment compiles numba's broadcasting and its messages
            union[g, w] = bits[rep, w]
            all_full[g, w] = full_bits[rep, w]
        for m in range(g * group + 1, min(g * group + group, num_q)):
            i = members[m]
            for w in range(words):
                union[g, w] |= bits[i, w]
                all_full[g, w] &= full_bits[i, w]
                objective += _popcount(bits[i, w] ^ bits[rep, w])
    return union, all_full, objective


@numba.njit(cache=True)
def _unpack(bits):
    """Bit rows back to BlockMask index rows: int32 counts and ascending int32 indices padded with 0."""
    counts = _row_popcounts(bits).astype(np.int32)
    widest = 1
    for count in counts:
        widest = max(widest, count)
    indices = np.zeros((bits.shape[0], widest), np.int32)
    one = np.uint64(1)
    for i in range(bits.shape[0]):
        k = 0
        for w in range(bits.shape[1]):
            word = bits[i, w]
            if word == 0:
                continue
            for b in range(64):
                if (word >> np.uint64(b)) & one:
                    indices[i, k] = w * 64 + b
                    k += 1
    return counts, indices


@numba.njit(cache=True, nogil=True)
def _merged_counts(bits, full_bits, group, xor):
    """`merged_counts` over the masks of the stack, one after another (without the GIL: `merged_counts_many` runs
    masks and stacks on threads)."""
    masks, num_q, _ = bits.shape
    num_groups = (num_q + group - 1) // group
    visited = np.zeros((masks, num_groups), np.int64)
    full = np.zeros((masks, num_groups), np.int64)
    for m in range(masks):
        members = _xor_greedy(bits[m], group) if xor else np.arange(num_q)
        union, all_full, _ = _group_stats(bits[m], full_bits[m], members, group)
        union_counts, full_counts = _row_popcounts(union), _row_popcounts(all_full)
        for g in range(num_groups):  # element by element: a row assignment compiles numba's broadcasting
            visited[m, g] = union_counts[g]
            full[m, g] = full_counts[g]
    return visited, full
