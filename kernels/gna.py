"""The GNA forward kernel over permuted tokens (multi-D tiles, static KV tiling) and its launcher.

One program handles one Q tile of one (batch, head). It finds its own KV tiles from the GNA parameters with
`window_bounds` (kernels/window.py), per dimension: from `start(first query) // T_KV` to
`ceil(end(last query) / T_KV) - 1`, where first/last are the tile's first and last real queries. It never
reads a precomputed block list, so its tile counts can be held against natsim's simulator.

Per visited KV tile it decides whether the tile is full (every real query attends every real key: per
dimension `start(last query) <= first key` and `end(first query) >= last real key + 1`). Full tiles skip the
window mask (a full tile that reaches into the group's padding masks only its padding keys), so
block-sparse configurations and dense attention run no mask code. The decision is a branch inside the one
KV loop: a second, mask-free copy of the loop would double the pipelined shared-memory buffers and no longer
fit a 128x128x128 tile on an H100.

The online softmax follows the usual flash-attention recurrence in base 2 with fp32 accumulators. Kernels
always see three dimensions (kernels/layout.py): a 1-D or 2-D problem has leading dimensions of length 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .window import window_bounds

LOG2E = 1.4426950408889634


@triton.jit
def _dim_setup(first, group_len, window, stride, CAUSAL: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr):
    """Per dimension: the Q tile's last real query, window bounds of first/last, and its KV tile range."""
    last = tl.minimum(first + TQ, group_len) - 1
    start_first, end_first = window_bounds(first, group_len, window, stride, CAUSAL)
    start_last, end_last = window_bounds(last, group_len, window, stride, CAUSAL)
    kv_lo = start_first // TK
    kv_hi = (end_last + TK - 1) // TK
    return start_last, end_first, kv_lo, kv_hi


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, v):
    """One online-softmax update with scores `qk` (already scaled to base 2) and values `v`."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def gna_forward_kernel(
    Q, K, V, O, LSE, COUNTS,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    heads, qk_scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DEBUG: tl.constexpr,
):
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)

    # Which dilation group and which tile of the group this program holds.
    q_tiles_per_group = NQ0 * NQ1 * NQ2
    group = q_tile // q_tiles_per_group
    t = q_tile % q_tiles_per_group
    g0 = group // (D1 * D2)
    g1 = (group // D2) % D1
    g2 = group % D2
    len0 = L0 // D0 + tl.where(g0 < L0 % D0, 1, 0)
    len1 = L1 // D1 + tl.where(g1 < L1 % D1, 1, 0)
    len2 = L2 // D2 + tl.where(g2 < L2 % D2, 1, 0)
    first0 = (t // (NQ1 * NQ2)) * TQ0
    first1 = ((t // NQ2) % NQ1) * TQ1
    first2 = (t % NQ2) * TQ2
    real_tile = (first0 < len0) & (first1 < len1) & (first2 < len2)

    sl0, ef0, lo0, hi0 = _dim_setup(first0, len0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, lo1, hi1 = _dim_setup(first1, len1, W1, S1, C1, TQ1, TK1)
    sl2, ef2, lo2, hi2 = _dim_setup(first2, len2, W2, S2, C2, TQ2, TK2)
    n1 = hi1 - lo1
    n2 = hi2 - lo2
    num_kv = tl.where(real_tile, (hi0 - lo0) * n1 * n2, 0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + (q_tile * BLOCK_M + rows).to(tl.int64)[:, None] * stride_qn
    q = tl.load(q_ptrs + dims[None, :])
    kv_group = group * (NK0 * NK1 * NK2)
    k_base = K + b * stride_kb + h * stride_kh + cols.to(tl.int64)[None, :] * stride_kn + dims[:, None]
    v_base = V + b * stride_vb + h * stride_vh + cols.to(tl.int64)[:, None] * stride_vn + dims[None, :]

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    unmasked = num_kv * 0

    # Per-row window bounds (in-group coordinates) and per-column key offsets inside a KV tile.
    qs0, qe0 = window_bounds(first0 + rows // (TQ1 * TQ2), len0, W0, S0, C0)
    qs1, qe1 = window_bounds(first1 + (rows // TQ2) % TQ1, len1, W1, S1, C1)
    qs2, qe2 = window_bounds(first2 + rows % TQ2, len2, W2, S2, C2)
    c0 = cols // (TK1 * TK2)
    c1 = (cols // TK2) % TK1
    c2 = cols % TK2
    for j in range(0, num_kv):
        k0 = lo0 + j // (n1 * n2)
        k1 = lo1 + (j // n2) % n1
        k2 = lo2 + j % n2
        offset = ((kv_group + (k0 * NK1 + k1) * NK2 + k2) * BLOCK_N).to(tl.int64)
        k = tl.load(k_base + offset * stride_kn)
        v = tl.load(v_base + offset * stride_vn)
        qk = tl.dot(q, k) * qk_scale
        first_key0 = k0 * TK0
        first_key1 = k1 * TK1
        first_key2 = k2 * TK2
        full = (sl0 <= first_key0) & (ef0 >= tl.minimum(first_key0 + TK0, len0))
        full &= (sl1 <= first_key1) & (ef1 >= tl.minimum(first_key1 + TK1, len1))
        full &= (sl2 <= first_key2) & (ef2 >= tl.minimum(first_key2 + TK2, len2))
        padded = (first_key0 + TK0 > len0) | (first_key1 + TK1 > len1) | (first_key2 + TK2 > len2)
        if full:
            if padded:
                real_key = (first_key0 + c0 < len0) & (first_key1 + c1 < len1) & (first_key2 + c2 < len2)
                qk = tl.where(real_key[None, :], qk, float("-inf"))
        else:
            key0 = first_key0 + c0
            key1 = first_key1 + c1
            key2 = first_key2 + c2
            keep = (key0[None, :] >= qs0[:, None]) & (key0[None, :] < qe0[:, None])
            keep &= (key1[None, :] >= qs1[:, None]) & (key1[None, :] < qe1[:, None])
            keep &= (key2[None, :] >= qs2[:, None]) & (key2[None, :] < qe2[:, None])
            keep &= ((key0 < len0) & (key1 < len1) & (key2 < len2))[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v)
        if DEBUG:
            unmasked += tl.where(full, 1, 0)

    # Padding queries (and only they) can end with no key at all: give them zeros, not 0 / 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + (q_tile * BLOCK_M + rows).to(tl.int64)[:, None] * stride_on
    tl.store(o_ptrs + dims[None, :], out.to(O.dtype.element_ty))
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        tokens = (q_tile * BLOCK_M + rows).to(tl.int64)
        tl.store(LSE + (b * tl.num_programs(0) * BLOCK_M + tokens) * heads + h, lse)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * q_tile, num_kv)
            tl.store(COUNTS + 2 * q_tile + 1, unmasked)
