"""The GNA backward kernels (multi-D tiles, static KV tiling, permuted layout), flash-attention style.

Three launches on permuted sequences `[B, tokens, heads, head_dim]` (kernels/permute.py; every dilation group
padded to whole tiles, zeros at padding), with the forward's natural-log LSE:

1. `delta_kernel`: `delta = rowsum(dO * O) - dLSE` per query, in fp32 (the softmax backward's row term; a
   gradient flowing into the LSE output enters here, since d lse / d score = p).
2. `dkdv_kernel`: one program per KV tile. It finds, per dimension, the Q tiles whose static KV range (the
   forward's `start(first) // T_KV .. ceil(end(last) / T_KV) - 1`, kernels/gna.py) holds this KV tile, by
   binary search over the Q tiles with `window_bounds` (start and end never decrease, so they form one run
   per dimension), and among those the run of full pairs. It recomputes `p = exp(q k^T * scale - lse)` for
   each visiting Q tile and accumulates `dV += p^T dO` and `dK += (p * (dO V^T - delta))^T Q * scale`.
3. `dq_kernel`: one program per Q tile over the same KV tiles as the forward (its `_dim_setup` /
   `_full_run`), accumulating `dQ += (p * (dO V^T - delta)) K * scale`. It runs on the mirrored tiles: the
   dK/dV kernel's KV box as its Q tile and its Q tile as the KV tile (128 queries against 64 keys, the
   forward's proportions), so that each K and V tile it loads serves 128 queries; q, dO, the LSE and delta
   are permuted into the KV tiles' order for it, k and v into the Q tiles'.

Both attention kernels run two loops as the forward does: the full box (every real query attends every key;
no padding keys) without any mask code, then the rest of the visited box (five slabs around it) under the
element mask. `MASKED=False` (the host's `needs_mask`: dense and block-sparse configurations) compiles the
first loop alone over the whole box. Padding queries carry dO = 0, delta = 0 and a finite LSE, so they add
nothing to dK and dV. The LSE and delta are read head-major (`[B, H, tokens]`, contiguous per head). With DEBUG
on, the dK/dV kernel counts per KV tile the Q tiles it ran and how many of them are full (gna-semantics.md's
definition), to be held against `natsim.simulate_backward`.

Tuning (`DEFAULT_VARIANT`, `benchmarks/backward.py --tune`, benchmarks/results/backward-tune-*.json): three
stages for both kernels, dQ on the mirrored tiles. `ATOMIC_DQ` (off) has the dK/dV kernel add each pair's
`ds k` to an fp32 dQ with atomics instead (five tile products per pair, no dQ kernel, dQ's summation order
varying from run to run): Nsight Compute showed its atomics missing L2 at HunyuanVideo sizes (40 GB of DRAM
traffic against 9 GB for the dK/dV kernel without them), and on the H100 `gna_backward` took 112.6 / 107.2 ms
with it against 106.2 / 102.9 ms without, at strides 1x8x8 / 16x8x8. `USE_TMA` (off) reads q, dO, k and v
through rank-2 tensor descriptors; it was not faster. The backward reads the permuted layout only (the
forward's in-place LAYOUT 1 is not mirrored here): `gna_backward` permutes.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from natsim import Problem

from .gna import LOG2E, _dim_setup, _full_run, _is_full, _tile_in_group
from .gna_launch import _install_allocator, dense_as_1d, needs_mask
from .layout import TileLayout, as_3d
from .permute import permute, unpermute
from .tiles import box_shapes, halves, relative_cost
from .window import window_bounds


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """`DELTA[r] = sum_d O[r, d] * DO[r, d] - DLSE[r]` over `rows` contiguous rows of `HEAD_DIM`."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    inside = r < rows
    offsets = r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    o = tl.load(O + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r, mask=inside, other=0.0)
    tl.store(DELTA + r, delta, mask=inside)


@triton.jit
def _first_q_tile(threshold, group_len, window, stride, STEPS, CAUSAL: tl.constexpr, TQ: tl.constexpr,
                  WHICH: tl.constexpr):
    """The first real Q tile (of `ceil(group_len / TQ)`) for which a monotone window test holds (their count
    when none does), by binary search in `STEPS` halvings. WHICH 0: end(last query) > threshold; 1:
    start(first query) >= threshold; 2: start(last query) > threshold; 3: end(first query) >= threshold."""
    lo = threshold * 0
    hi = lo + (group_len + TQ - 1) // TQ
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        first = mid * TQ
        if WHICH == 0 or WHICH == 2:
            query = tl.minimum(first + TQ, group_len) - 1
        else:
            query = tl.minimum(first, group_len - 1)
        start, end = window_bounds(query, group_len, window, stride, CAUSAL)
        if WHICH == 0:
            holds = end > threshold
        elif WHICH == 1:
            holds = start >= threshold
        elif WHICH == 2:
            holds = start > threshold
        else:
            holds = end >= threshold
        searching = lo < hi
        lo = tl.where(searching, tl.where(holds, lo, mid + 1), lo)
        hi = tl.where(searching & holds, mid, hi)
    return lo


@triton.jit
def _q_runs(kv, group_len, window, stride, STEPS, CAUSAL: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr):
    """Per dimension, for KV tile `kv`: the run [a, b) of Q tiles whose static KV range holds it (the inverse
    of the forward's `_dim_setup`), the run [f, g) of them whose pair is full without padding keys (what
    the unmasked loop may take), and the end of the run of full pairs by gna-semantics.md (`g_debug`, where
    the tile's padding keys do not count)."""
    key_lo = kv * TK
    key_hi = key_lo + TK
    a = _first_q_tile(key_lo, group_len, window, stride, STEPS, CAUSAL, TQ, 0)
    b = tl.maximum(_first_q_tile(key_hi, group_len, window, stride, STEPS, CAUSAL, TQ, 1), a)
    f = tl.minimum(tl.maximum(_first_q_tile(key_hi, group_len, window, stride, STEPS, CAUSAL, TQ, 3), a), b)
    g = tl.maximum(tl.minimum(_first_q_tile(key_lo, group_len, window, stride, STEPS, CAUSAL, TQ, 2), b), f)
    return a, b, f, g


@triton.jit
def _slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2):
    """The j-th tile of the box [lo, hi) minus its inner box [f, g), in five slabs: below / above the inner
    run along dimension 0, then inside it below / above along dimension 1, then below / above along 2."""
    n1 = hi1 - lo1
    n2 = hi2 - lo2
    m0 = g0 - f0
    m1 = g1 - f1
    size_a = (f0 - lo0) * n1 * n2
    size_b = (hi0 - g0) * n1 * n2
    size_c = m0 * (f1 - lo1) * n2
    size_d = m0 * (hi1 - g1) * n2
    size_e = m0 * m1 * (f2 - lo2)
    in_a = j < size_a
    j_b = j - size_a
    in_b = j_b < size_b
    j_c = j_b - size_b
    in_c = j_c < size_c
    j_d = j_c - size_c
    in_d = j_d < size_d
    j_e = j_d - size_d
    in_e = j_e < size_e
    j_f = j_e - size_e
    r = tl.where(in_a, j, tl.where(in_b, j_b, tl.where(in_c, j_c, tl.where(in_d, j_d, tl.where(in_e, j_e, j_f)))))
    a0 = tl.where(in_a, lo0, tl.where(in_b, g0, f0))
    a1 = tl.where(in_a | in_b | in_c, lo1, tl.where(in_d, g1, f1))
    a2 = tl.where(in_a | in_b | in_c | in_d | in_e, lo2, g2)
    e1 = tl.where(in_a | in_b, n1, tl.where(in_c, f1 - lo1, tl.where(in_d, hi1 - g1, m1)))
    e2 = tl.where(in_a | in_b | in_c | in_d, n2, tl.where(in_e, f2 - lo2, hi2 - g2))
    r2 = r // e2
    r1 = r2 // e1
    return a0 + r1, a1 + (r2 - r1 * e1), a2 + (r - r2 * e2)


@triton.jit
def _next_tile(k0, k1, k2, f1, g1, f2, g2):
    """The next tile of a box in row-major order: step the last dimension, carry into the ones before it."""
    k2 += 1
    wrap2 = k2 == g2
    k2 = tl.where(wrap2, f2, k2)
    k1 += tl.where(wrap2, 1, 0)
    wrap1 = k1 == g1
    k1 = tl.where(wrap1, f1, k1)
    k0 += tl.where(wrap1, 1, 0)
    return k0, k1, k2


@triton.jit
def _window_mask(q_first0, q_first1, q_first2, k_first0, k_first1, k_first2, len0, len1, len2,
                 W0, W1, W2, S0, S1, S2, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                 TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
                 TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """`[BLOCK_M, BLOCK_N]` mask (`[BLOCK_N, BLOCK_M]` when KEYS_FIRST): query row r of the Q tile at `q_first`
    attends key column c of the KV tile at `k_first` (in-group coordinates). Windows end inside the group, so
    padding keys are dropped too."""
    rows = tl.arange(0, TQ0 * TQ1 * TQ2)
    cols = tl.arange(0, TK0 * TK1 * TK2)
    s0, e0 = window_bounds(q_first0 + rows // (TQ1 * TQ2), len0, W0, S0, C0)
    s1, e1 = window_bounds(q_first1 + (rows // TQ2) % TQ1, len1, W1, S1, C1)
    s2, e2 = window_bounds(q_first2 + rows % TQ2, len2, W2, S2, C2)
    y0 = k_first0 + cols // (TK1 * TK2)
    y1 = k_first1 + (cols // TK2) % TK1
    y2 = k_first2 + cols % TK2
    if KEYS_FIRST:
        keep = (y0[:, None] - s0[None, :]).to(tl.uint32) < (e0 - s0).to(tl.uint32)[None, :]
        keep &= (y1[:, None] - s1[None, :]).to(tl.uint32) < (e1 - s1).to(tl.uint32)[None, :]
        keep &= (y2[:, None] - s2[None, :]).to(tl.uint32) < (e2 - s2).to(tl.uint32)[None, :]
    else:
        keep = (y0[None, :] - s0[:, None]).to(tl.uint32) < (e0 - s0).to(tl.uint32)[:, None]
        keep &= (y1[None, :] - s1[:, None]).to(tl.uint32) < (e1 - s1).to(tl.uint32)[:, None]
        keep &= (y2[None, :] - s2[:, None]).to(tl.uint32) < (e2 - s2).to(tl.uint32)[:, None]
    return keep


@triton.jit
def _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2,
               C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
               TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
               TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """1 when every real query of Q tile (t0, t1, t2) attends every real key of KV tile (j0, j1, j2) (DEBUG)."""
    sl0, ef0, _, _ = _dim_setup(t0 * TQ0, len0, len0, 0, 0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, _, _ = _dim_setup(t1 * TQ1, len1, len1, 0, 0, W1, S1, C1, TQ1, TK1)
    sl2, ef2, _, _ = _dim_setup(t2 * TQ2, len2, len2, 0, 0, W2, S2, C2, TQ2, TK2)
    return _is_full(j0, j1, j2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2, TK0, TK1, TK2)


@triton.jit
def _head_rows(P, base, tokens, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, USE_TMA: tl.constexpr):
    """What `_rows` reads one head of a permuted `[B, tokens, heads, HEAD_DIM]` tensor through: a rank-2 tensor
    descriptor at `P + base` in boxes of BLOCK rows (USE_TMA), else the pointer `P` itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(P + base, shape=[tokens, HEAD_DIM], strides=[heads * HEAD_DIM, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    else:
        return P


@triton.jit
def _rows(source, offsets, row0, USE_TMA: tl.constexpr):
    """Rows `row0 ..` of one head: a descriptor box (USE_TMA), else a pointer load at `source + offsets`."""
    if USE_TMA:
        return source.load([row0, 0])
    else:
        return tl.load(source + offsets)


@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, keep, MASKED: tl.constexpr):
    """One visiting Q tile's contribution to dK (unscaled) and dV, and `ds^T` (`[keys, queries]`, for an
    atomic dQ); `keep` is `[keys, queries]` when MASKED."""
    qk = tl.dot(k, tl.trans(q))
    p = tl.math.exp2(qk * qk_scale - lse2[None, :])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dv = tl.dot(p.to(do.dtype), do, dv)
    dp = tl.dot(v, tl.trans(do))
    ds = (p * (dp - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds, q, dk)
    return dk, dv, ds


@triton.jit
def _add_dq(DQ, q_offsets, ds, k, scale):
    """ATOMIC_DQ: add this pair's `ds k * scale` to the fp32 dQ rows (relaxed atomics; order is irrelevant)."""
    tl.atomic_add(DQ + q_offsets, tl.dot(tl.trans(ds), k) * scale, sem="relaxed")


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, COUNTS,
    q_tokens, kv_tokens, heads, qk_scale, scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2, STEPS0, STEPS1, STEPS2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DEBUG: tl.constexpr, ATOMIC_DQ: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    kv_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    group, gi0, gi1, gi2, len0, len1, len2, j0, j1, j2 = _tile_in_group(kv_tile, L0, L1, L2, D0, D1, D2,
                                                                         NK0, NK1, NK2)

    # Which Q tiles visit this KV tile, per dimension: [lo, hi), and the full run [f, g) inside it.
    lo0, hi0, f0, g0 = _q_runs(j0, len0, W0, S0, STEPS0, C0, TQ0, TK0)
    lo1, hi1, f1, g1 = _q_runs(j1, len1, W1, S1, STEPS1, C1, TQ1, TK1)
    lo2, hi2, f2, g2 = _q_runs(j2, len2, W2, S2, STEPS2, C2, TQ2, TK2)
    num_q = (hi0 - lo0) * (hi1 - lo1) * (hi2 - lo2)
    if MASKED:
        empty = (g0 == f0) | (g1 == f1) | (g2 == f2)
        g0 = tl.where(empty, f0, g0)
        num_full = (g0 - f0) * (g1 - f1) * (g2 - f2)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_q

    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q_group = group * (NQ0 * NQ1 * NQ2)
    q_base = b * q_tokens * heads * HEAD_DIM + h * HEAD_DIM
    kv_base = b * kv_tokens * heads * HEAD_DIM + h * HEAD_DIM
    kv_offsets = kv_base + (kv_tile * BLOCK_N + cols).to(tl.int64)[:, None] * (heads * HEAD_DIM) + dims[None, :]
    q_src = _head_rows(Q, q_base, q_tokens, heads, HEAD_DIM, BLOCK_M, USE_TMA)
    do_src = _head_rows(DO, q_base, q_tokens, heads, HEAD_DIM, BLOCK_M, USE_TMA)
    k = _rows(_head_rows(K, kv_base, kv_tokens, heads, HEAD_DIM, BLOCK_N, USE_TMA), kv_offsets,
              kv_tile * BLOCK_N, USE_TMA)
    v = _rows(_head_rows(V, kv_base, kv_tokens, heads, HEAD_DIM, BLOCK_N, USE_TMA), kv_offsets,
              kv_tile * BLOCK_N, USE_TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    visited = num_q * 0
    full = num_q * 0

    # Loop 1: the full pairs, no mask code (without MASKED, every visiting Q tile).
    t0 = f0
    t1 = f1
    t2 = f2
    for _ in tl.range(0, num_full):
        tile = q_group + (t0 * NQ1 + t1) * NQ2 + t2
        tokens = (tile * BLOCK_M + rows).to(tl.int64)
        q_offsets = q_base + tokens[:, None] * (heads * HEAD_DIM) + dims[None, :]
        q = _rows(q_src, q_offsets, tile * BLOCK_M, USE_TMA)
        do = _rows(do_src, q_offsets, tile * BLOCK_M, USE_TMA)
        stat = bh.to(tl.int64) * q_tokens + tokens
        lse2 = tl.load(LSE + stat) * 1.4426950408889634
        delta = tl.load(DELTA + stat)
        dk, dv, ds = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, 0, False)
        if ATOMIC_DQ:
            _add_dq(DQ, q_offsets, ds, k, scale)
        if DEBUG:
            visited += 1
            full += _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                               TQ0, TQ1, TQ2, TK0, TK1, TK2)
        t0, t1, t2 = _next_tile(t0, t1, t2, f1, g1, f2, g2)

    # Loop 2: every other visiting Q tile, under the element mask.
    if MASKED:
        for j in tl.range(0, num_q - num_full):
            t0, t1, t2 = _slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2)
            tile = q_group + (t0 * NQ1 + t1) * NQ2 + t2
            tokens = (tile * BLOCK_M + rows).to(tl.int64)
            q_offsets = q_base + tokens[:, None] * (heads * HEAD_DIM) + dims[None, :]
            q = _rows(q_src, q_offsets, tile * BLOCK_M, USE_TMA)
            do = _rows(do_src, q_offsets, tile * BLOCK_M, USE_TMA)
            stat = bh.to(tl.int64) * q_tokens + tokens
            lse2 = tl.load(LSE + stat) * 1.4426950408889634
            delta = tl.load(DELTA + stat)
            keep = _window_mask(t0 * TQ0, t1 * TQ1, t2 * TQ2, j0 * TK0, j1 * TK1, j2 * TK2,
                                len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                                TQ0, TQ1, TQ2, TK0, TK1, TK2, True)
            dk, dv, ds = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, keep, True)
            if ATOMIC_DQ:
                _add_dq(DQ, q_offsets, ds, k, scale)
            if DEBUG:
                visited += 1
                full += _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                                   TQ0, TQ1, TQ2, TK0, TK1, TK2)

    tl.store(DK + kv_offsets, (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty))
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * kv_tile, visited)
            tl.store(COUNTS + 2 * kv_tile + 1, full)


@triton.jit
def _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, keep, MASKED: tl.constexpr):
    """One visited KV tile's contribution to dQ (unscaled); `keep` is `[queries, keys]` when MASKED."""
    qk = tl.dot(q, tl.trans(k))
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    q_tokens, kv_tokens, heads, qk_scale, scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    group, gi0, gi1, gi2, len0, len1, len2, i0, i1, i2 = _tile_in_group(q_tile, L0, L1, L2, D0, D1, D2,
                                                                         NQ0, NQ1, NQ2)
    first0 = i0 * TQ0
    first1 = i1 * TQ1
    first2 = i2 * TQ2
    real_tile = (first0 < len0) & (first1 < len1) & (first2 < len2)

    # The forward's KV tiles of this Q tile, and the full box inside them.
    sl0, ef0, lo0, hi0 = _dim_setup(first0, len0, len0, 0, 0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, lo1, hi1 = _dim_setup(first1, len1, len1, 0, 0, W1, S1, C1, TQ1, TK1)
    sl2, ef2, lo2, hi2 = _dim_setup(first2, len2, len2, 0, 0, W2, S2, C2, TQ2, TK2)
    num_kv = tl.where(real_tile, (hi0 - lo0) * (hi1 - lo1) * (hi2 - lo2), 0)
    if MASKED:
        f0, g0 = _full_run(sl0, ef0, lo0, hi0, TK0)
        f1, g1 = _full_run(sl1, ef1, lo1, hi1, TK1)
        f2, g2 = _full_run(sl2, ef2, lo2, hi2, TK2)
        empty = (g0 == f0) | (g1 == f1) | (g2 == f2)
        g0 = tl.where(empty, f0, g0)
        num_full = tl.where(real_tile, (g0 - f0) * (g1 - f1) * (g2 - f2), 0)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_kv

    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_group = group * (NK0 * NK1 * NK2)
    kv_head = b * kv_tokens * heads * HEAD_DIM + h * HEAD_DIM
    kv_base = kv_head + cols.to(tl.int64)[:, None] * (heads * HEAD_DIM)
    k_src = _head_rows(K, kv_head, kv_tokens, heads, HEAD_DIM, BLOCK_N, USE_TMA)
    v_src = _head_rows(V, kv_head, kv_tokens, heads, HEAD_DIM, BLOCK_N, USE_TMA)
    tokens = (q_tile * BLOCK_M + rows).to(tl.int64)
    q_head = b * q_tokens * heads * HEAD_DIM + h * HEAD_DIM
    q_offsets = q_head + tokens[:, None] * (heads * HEAD_DIM) + dims[None, :]
    q = _rows(_head_rows(Q, q_head, q_tokens, heads, HEAD_DIM, BLOCK_M, USE_TMA), q_offsets, q_tile * BLOCK_M,
              USE_TMA)
    do = _rows(_head_rows(DO, q_head, q_tokens, heads, HEAD_DIM, BLOCK_M, USE_TMA), q_offsets, q_tile * BLOCK_M,
               USE_TMA)
    stat = bh.to(tl.int64) * q_tokens + tokens
    lse2 = tl.load(LSE + stat) * 1.4426950408889634
    delta = tl.load(DELTA + stat)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    k0 = f0
    k1 = f1
    k2 = f2
    for _ in tl.range(0, num_full):
        tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
        kv_offsets = kv_base + (tile * BLOCK_N).to(tl.int64) * (heads * HEAD_DIM) + dims[None, :]
        k = _rows(k_src, kv_offsets, tile * BLOCK_N, USE_TMA)
        v = _rows(v_src, kv_offsets, tile * BLOCK_N, USE_TMA)
        dq = _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, 0, False)
        k0, k1, k2 = _next_tile(k0, k1, k2, f1, g1, f2, g2)

    if MASKED:
        for j in tl.range(0, num_kv - num_full):
            k0, k1, k2 = _slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2)
            tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
            kv_offsets = kv_base + (tile * BLOCK_N).to(tl.int64) * (heads * HEAD_DIM) + dims[None, :]
            k = _rows(k_src, kv_offsets, tile * BLOCK_N, USE_TMA)
            v = _rows(v_src, kv_offsets, tile * BLOCK_N, USE_TMA)
            keep = _window_mask(first0, first1, first2, k0 * TK0, k1 * TK1, k2 * TK2, len0, len1, len2,
                                W0, W1, W2, S0, S1, S2, C0, C1, C2, TQ0, TQ1, TQ2, TK0, TK1, TK2, False)
            dq = _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, keep, True)

    tl.store(DQ + q_offsets, (dq * scale).to(DQ.dtype.element_ty))


# -- host side: tiles, permutation, launches --------------------------------------------------------------------

KV_TILE_TOKENS = 128  # keys per backward KV tile; its Q tile holds 1 / 2**Q_TILE_HALVINGS as many queries
# 1: 64 queries per 128 keys. 2 (32 queries) keeps the dK/dV kernel's registers under 255 without spills at
# head_dim 128 on sm_90 (benchmarks/compile_backward.py); benchmarks/backward.py --tune times both.
Q_TILE_HALVINGS = 1
DELTA_ROWS = 64
# The variant `backward_permuted` runs unless told otherwise: launch options and tuning switches (ATOMIC_DQ,
# USE_TMA) over `_launch_options`' defaults; benchmarks/backward.py --tune times the alternatives.
DEFAULT_VARIANT: dict = {"ATOMIC_DQ": False, "num_stages": 3}  # the H100 tune's winner (module docstring)
# Tile products per visited (Q tile, KV tile) pair: the dK/dV kernel's q k^T, dO v^T, p^T dO and ds^T q (plus
# ds^T k with ATOMIC_DQ), and the dQ kernel's q k^T, dO v^T and ds k on its own (mirrored) pairs.
DKDV_PRODUCTS = 4
DQ_PRODUCTS = 3
# Tiles for layouts too small for any 128-token box: the forward's fallback shapes, queries halved.
FALLBACK_TILES = {1: ((64,), (128,)), 2: ((8, 8), (16, 8)), 3: ((1, 8, 8), (2, 8, 8))}


def backward_tiles(problem: Problem, head_dim: int,
                   q_halvings: Optional[int] = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The backward's (Q tile, KV tile): KV boxes of 128 keys and Q tiles of half of one (the mirror of the
    forward's 128-query / 64-key pairs: the dK/dV program keeps two `[keys, head_dim]` fp32 accumulators), or
    of a quarter with `q_halvings=2` (default: Q_TILE_HALVINGS), the one with the least predicted work by the
    forward's relative costs (kernels/tiles.py)."""
    return _backward_tiles(problem, head_dim, Q_TILE_HALVINGS if q_halvings is None else q_halvings)


def _q_shapes(kv_shape: tuple[int, ...], q_halvings: int) -> list[tuple[int, ...]]:
    """Q tile shapes of `kv_shape` halved `q_halvings` times (along any dimensions), in a fixed order."""
    shapes = [kv_shape]
    for _ in range(q_halvings):
        shapes = list(dict.fromkeys(half for shape in shapes for half in halves(shape)))
    return shapes


@functools.lru_cache(maxsize=512)
def _backward_tiles(problem: Problem, head_dim: int, q_halvings: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    limits = [1 << (length - 1).bit_length() for length in problem.shape]
    pairs = [(q_shape, kv_shape) for kv_shape in box_shapes(KV_TILE_TOKENS, limits)
             for q_shape in _q_shapes(kv_shape, q_halvings)]
    if not pairs:
        return FALLBACK_TILES[problem.ndim]
    return min(pairs, key=lambda pair: relative_cost(problem, pair[0], pair[1], head_dim))


def _launch_options(block_m: int, block_n: int, head_dim: int) -> dict:
    """8 warps once a tile's fp32 accumulators reach 64 KiB (128 keys x 128 channels), else 4; two stages
    (`DEFAULT_VARIANT` raises both kernels to three)."""
    return dict(num_warps=8 if max(block_m, block_n) * head_dim >= 128 * 128 else 4, num_stages=2)


def _problem_arguments(problem: Problem, q_layout: TileLayout, kv_layout: TileLayout) -> dict:
    """The scalar and compile-time GNA arguments the two attention kernels share."""
    return dict(
        **dict(zip(("L0", "L1", "L2"), q_layout.shape)),
        **dict(zip(("W0", "W1", "W2"), as_3d(problem.window))),
        **dict(zip(("S0", "S1", "S2"), as_3d(problem.stride))),
        **dict(zip(("D0", "D1", "D2"), q_layout.dilation)),
        **dict(zip(("NQ0", "NQ1", "NQ2"), q_layout.tiles_per_group)),
        **dict(zip(("NK0", "NK1", "NK2"), kv_layout.tiles_per_group)),
        **dict(zip(("C0", "C1", "C2"), as_3d(problem.causal, False))),
        **dict(zip(("TQ0", "TQ1", "TQ2"), q_layout.tile)),
        **dict(zip(("TK0", "TK1", "TK2"), kv_layout.tile)),
    )


def backward_permuted(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, q_tile: tuple[int, ...],
                      kv_tile: tuple[int, ...], scale: float, debug: bool = False, options: Optional[dict] = None,
                      mirrored: Optional[tuple] = None):
    """dq, dk, dv (and, with `debug`, the dK/dV kernel's `[KV tiles, 2]` counts of visiting Q tiles and full
    pairs, else None) of permuted contiguous tensors: q, out, grad_out `[B, q tokens, H, D]` and lse, grad_lse
    (or None) `[B, q tokens, H]` fp32 in `q_tile` order; k, v `[B, kv tokens, H, D]` in `kv_tile` order; dq
    comes back in `q_tile` order, dk and dv in `kv_tile` order.

    Without ATOMIC_DQ, dQ runs on the mirrored tiles (`kv_tile` queries, `q_tile` keys: 128 queries against
    64 keys, so that each K/V tile it loads serves twice the queries), on q, dO, LSE, delta in `kv_tile` order
    and k, v in `q_tile` order: `mirrored=(q, grad_out, k, v)` in those orders if the caller has them, else they
    are permuted here. `options` override the launch options (`num_warps`, `num_stages`; benchmarks/backward.py
    --tune) and the tuning switches (module docstring); `DQ_STAGES` sets the dQ kernel's stages alone."""
    dq, dq_tile, dk, dv, counts = _backward(q, k, v, out, lse, grad_out, grad_lse, problem, q_tile, kv_tile, scale,
                                            debug, options, mirrored)
    return (dq if dq_tile == q_tile else _repermute(dq, problem, dq_tile, q_tile)), dk, dv, counts


def _backward(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, q_tile, kv_tile, scale: float, debug: bool,
              options: Optional[dict], mirrored: Optional[tuple]):
    """`backward_permuted`'s work: dq and the tile order it comes in (`q_tile`, or `kv_tile` from the mirrored
    dQ kernel), dk, dv, counts."""
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    options = {**DEFAULT_VARIANT, **(options or {})}
    atomic = bool(options.pop("ATOMIC_DQ", False))
    dq_stages = options.pop("DQ_STAGES", None)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    rows = q.shape[0] * q.shape[1] * heads
    delta_kernel[(triton.cdiv(rows, DELTA_ROWS),)](out, grad_out, delta if grad_lse is None else grad_lse, delta,
                                                 rows, HEAD_DIM=head_dim, BLOCK=DELTA_ROWS,
                                                 HAS_DLSE=grad_lse is not None)
    head_major = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [B, H, tokens]: contiguous per head
    dk, dv, dq, counts = _dkdv(q, k, v, grad_out, head_major(lse), head_major(delta), problem, q_tile, kv_tile,
                               scale, debug, atomic, dict(options))
    if atomic:
        return dq.to(q.dtype), q_tile, dk, dv, counts
    if mirrored is None:
        mirrored = tuple(_repermute(x, problem, tile, other)
                         for x, tile, other in ((q, q_tile, kv_tile), (grad_out, q_tile, kv_tile),
                                                (k, kv_tile, q_tile), (v, kv_tile, q_tile)))
    stats = (head_major(_repermute(x[..., None], problem, q_tile, kv_tile)[..., 0]) for x in (lse, delta))
    if dq_stages is not None:
        options["num_stages"] = dq_stages
    return _dq(*mirrored, *stats, problem, kv_tile, q_tile, scale, options), kv_tile, dk, dv, counts


def _repermute(x, problem: Problem, tile: tuple[int, ...], other: tuple[int, ...]):
    """A permuted `[B, tokens, ...]` tensor in `tile` order, permuted into `other` order instead."""
    batch, rest = x.shape[0], x.shape[2:]
    return permute(unpermute(x, problem.shape, tile, problem.dilation).reshape(batch, *problem.shape, *rest),
                   other, problem.dilation)


def _dkdv(q, k, v, grad_out, lse, delta, problem: Problem, q_tile, kv_tile, scale: float, debug: bool,
          atomic: bool, options: dict):
    """The dK/dV kernel's launch: dk, dv, dq (fp32, summed by atomics; None without `atomic`), counts."""
    q_layout = TileLayout(problem.shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(problem.shape, kv_tile, problem.dilation).to_3d()
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    options = {**_launch_options(q_layout.tile_tokens, kv_layout.tile_tokens, head_dim), **options}
    if options.get("USE_TMA"):
        _install_allocator()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else None
    counts = torch.zeros((kv_layout.num_tiles, 2), dtype=torch.int32, device=q.device) if debug else None
    steps = {f"STEPS{i}": n.bit_length() + 1 for i, n in enumerate(q_layout.tiles_per_group)}
    dkdv_kernel[(kv_layout.num_tiles, batch * heads)](
        q, k, v, grad_out, lse, delta, dk, dv, dk if dq is None else dq, delta if counts is None else counts,
        q_tokens=q_layout.num_tokens, kv_tokens=kv_layout.num_tokens, heads=heads, qk_scale=scale * LOG2E,
        scale=scale, HEAD_DIM=head_dim, MASKED=needs_mask(problem, q_tile, kv_tile),
        **_problem_arguments(problem, q_layout, kv_layout), **steps, DEBUG=debug, ATOMIC_DQ=atomic, **options)
    return dk, dv, dq, counts


def _dq(q, grad_out, k, v, lse, delta, problem: Problem, q_tile, kv_tile, scale: float, options: dict):
    """The dQ kernel's launch on its own tiles (q, grad_out, lse, delta in `q_tile` order; k, v in `kv_tile`)."""
    q_layout = TileLayout(problem.shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(problem.shape, kv_tile, problem.dilation).to_3d()
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    options = {**_launch_options(q_layout.tile_tokens, kv_layout.tile_tokens, head_dim), **options}
    if options.get("USE_TMA"):
        _install_allocator()
    dq = torch.empty_like(q)
    dq_kernel[(q_layout.num_tiles, batch * heads)](
        q, k, v, grad_out, lse, delta, dq, q_tokens=q_layout.num_tokens, kv_tokens=kv_layout.num_tokens,
        heads=heads, qk_scale=scale * LOG2E, scale=scale, HEAD_DIM=head_dim,
        MASKED=needs_mask(problem, q_tile, kv_tile), **_problem_arguments(problem, q_layout, kv_layout), **options)
    return dq


def gna_backward(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, scale: Optional[float] = None,
                 q_tile: Optional[tuple[int, ...]] = None, kv_tile: Optional[tuple[int, ...]] = None):
    """dq, dk, dv of GNA on `[B, *shape, H, D]` tensors, from the forward's output and natural-log LSE
    `[B, *shape, H]`; `grad_lse` may be None. Tiles default to `backward_tiles` (dense attention as 1-D over the
    flattened layout, as the forward runs it). Runs on the permuted layout: permute, the kernels, unpermute."""
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    shape = tuple(q.shape[1:-2])
    if q_tile is None and kv_tile is None:
        flat = dense_as_1d(problem)
        if flat is not None:
            problem = flat
        q_tile, kv_tile = backward_tiles(problem, head_dim)
    dilation = problem.dilation

    def tokens(x, tile):  # [B, *problem.shape, H, D] permuted; detached: the backward tracks no graph
        return permute(x.detach().reshape(batch, *problem.shape, *x.shape[len(shape) + 1:]), tile, dilation)

    def stats(x):  # [B, *shape, H] fp32 as a permuted [B, tokens, H]
        return tokens(x.float()[..., None], q_tile)[..., 0].contiguous()

    grad_out = grad_out.to(q.dtype)
    mirrored = None
    if not DEFAULT_VARIANT.get("ATOMIC_DQ", False):  # the dQ kernel's own orders, permuted once from the inputs
        mirrored = (tokens(q, kv_tile), tokens(grad_out, kv_tile), tokens(k, q_tile), tokens(v, q_tile))
    dq, dq_tile, dk, dv, _ = _backward(
        tokens(q, q_tile), tokens(k, kv_tile), tokens(v, kv_tile), tokens(out, q_tile), stats(lse),
        tokens(grad_out, q_tile), None if grad_lse is None else stats(grad_lse), problem,
        q_tile, kv_tile, scale, False, None, mirrored,
    )
    return tuple(unpermute(g, problem.shape, tile, dilation).reshape(q.shape)
                 for g, tile in ((dq, dq_tile), (dk, kv_tile), (dv, kv_tile)))


def backward_tile_counts(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...], head_dim: int = 32,
                         device: str = "cuda", dtype: torch.dtype = torch.float16):
    """Run the backward with the dK/dV kernel's debug counters on (random permuted inputs, batch 1, one head)
    and return `(visited, full)` per KV tile in permuted order: the Q tiles it ran and how many of those pairs
    are full. Compare with `natsim.simulate_backward`."""
    q_tokens = TileLayout(problem.shape, q_tile, problem.dilation).num_tokens
    kv_tokens = TileLayout(problem.shape, kv_tile, problem.dilation).num_tokens
    q, out, grad_out = (torch.randn((1, q_tokens, 1, head_dim), device=device, dtype=dtype) for _ in range(3))
    k, v = (torch.randn((1, kv_tokens, 1, head_dim), device=device, dtype=dtype) for _ in range(2))
    lse = torch.zeros((1, q_tokens, 1), device=device)
    *_, counts = backward_permuted(q, k, v, out, lse, grad_out, None, problem, q_tile, kv_tile, head_dim**-0.5,
                                   debug=True)
    counts = counts.cpu().numpy().astype("int64")
    return counts[:, 0], counts[:, 1]
