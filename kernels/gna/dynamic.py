"""The GNA forward kernel with dynamic KV tiling (gna-semantics.md, section 2); launched by kernels/gna/launch.py.

Static KV tiling (kernels/gna/forward.py) visits the KV tiles of a fixed grid that the Q tile's keys overlap. Dynamic
KV tiling, the original FNA's choice, cuts out exactly the keys the Q tile needs and tiles that box: per
dimension the box is `[start(first), end(last))`, the window bounds of the tile's first and last real
queries, walked in KV tiles of the configured shape from the box's corner. Along one dimension the box takes
`ceil((end(last) - start(first)) / T_KV)` tiles, against up to one more for the grid tiles it straddles; the
simulator counts both modes (`natsim.simulate(..., TileConfig(..., kv_tiling="dynamic"))`) and the kernel's
debug counters are held against it.

Where a box tile comes from:

- `LAYOUT` 1 (the caller's `[B, L0, L1, L2, H, D]` in place, Hopper): one rank-4 descriptor load at the tile's
  corner, which may be any coordinate; keys past the layout's end read as zeros. No gather at all.
- `LAYOUT` 2 (a 1-D layout in place): one rank-2 descriptor load at the tile's first row.
- `LAYOUT` 0 (permuted sequences: dilation groups, GPUs before Hopper): a box tile straddles up to eight
  stored tiles, so its keys are gathered with pointer loads, each key's permuted position worked out from its
  in-group coordinates (kernels/gna/layout.py); keys past the group's end are not read.

The two KV loops are those of the static kernel: loop 1 runs, without any mask code, the box tiles every real
query attends completely and that hold no key past the group's end (per dimension one run of the box's tiles,
so together a sub-box); loop 2 runs every other box tile under the element mask, the box minus the sub-box
taken as six slabs. With `DEBUG` the kernel writes per Q tile the box tiles it visited and how many of them
are full in the simulator's sense (every real (query, key) pair attended, keys past the group's end ignored).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.headdim import chunked_dot, load_columns
from ..common.softmax import softmax_step
from .geometry import (in_windows, inner_box, is_full, next_tile, row_windows, slab_tile, tile_coordinates,
                       tile_in_group, window_bounds)
from .tile_io import kv_descriptors, load_q_tile, program_tile, store_output


@triton.jit
def _box(first, group_len, window, stride, CAUSAL: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr):
    """Per dimension: the box origin `start(first)`, its tile count, the run [f, g) of tiles loop 1 may run
    unmasked, and `start(last)` / `end(first)` for the full-tile test."""
    last = tl.minimum(first + TQ, group_len) - 1
    start_first, end_first = window_bounds(first, group_len, window, stride, CAUSAL)
    start_last, end_last = window_bounds(last, group_len, window, stride, CAUSAL)
    count = (end_last - start_first + TK - 1) // TK
    # Tile m covers keys [o + m * TK, o + (m + 1) * TK): every real query attends all of them, none past the
    # group's end, iff o + m * TK >= start(last) and o + (m + 1) * TK <= end(first) (which is <= group_len).
    f = tl.minimum((start_last - start_first + TK - 1) // TK, count)
    g = tl.minimum((end_first - start_first) // TK, count)
    return start_first, count, f, tl.maximum(f, g), start_last, end_first


@triton.jit
def _gather_offsets(key0, key1, key2, c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2,
                    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """Permuted positions of a box tile's keys (one per column) and which of them lie inside the group."""
    y0 = key0 + c0
    y1 = key1 + c1
    y2 = key2 + c2
    stored = kv_group + ((y0 // TK0) * NK1 + y1 // TK1) * NK2 + y2 // TK2
    inside = ((y0 % TK0) * TK1 + y1 % TK1) * TK2 + y2 % TK2
    position = stored.to(tl.int64) * (TK0 * TK1 * TK2) + inside
    return position, (y0 < len0) & (y1 < len1) & (y2 < len2)


@triton.jit
def _load_box_chunk(key0, key1, key2, k_desc, v_desc, K_head, V_head, stride_kn, stride_vn,
                    c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2,
                    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
                    OFFSET: tl.constexpr, WIDTH: tl.constexpr, LAYOUT: tl.constexpr, BOUNDED: tl.constexpr):
    """Columns `[OFFSET, OFFSET + WIDTH)` of `_load_box_tile`'s K and V, zeros past head_dim."""
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if LAYOUT == 1:
        corner = [key0, key1, key2, OFFSET]
        k = k_desc.load(corner).reshape([BLOCK_N, WIDTH]).T
        v = v_desc.load(corner).reshape([BLOCK_N, WIDTH])
    elif LAYOUT == 2:
        k = k_desc.load([key2, OFFSET]).T
        v = v_desc.load([key2, OFFSET])
    else:
        position, inside = _gather_offsets(key0, key1, key2, c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2,
                                           TK0, TK1, TK2)
        if BOUNDED:
            row_ok = inside
        else:
            row_ok = None
        k = load_columns(K_head, position * stride_kn, OFFSET, WIDTH, HEAD_DIM, row_ok, TRANSPOSED=True)
        v = load_columns(V_head, position * stride_vn, OFFSET, WIDTH, HEAD_DIM, row_ok)
    return k, v


@triton.jit
def _load_box_tile(key0, key1, key2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, K_head, V_head, stride_kn, stride_vn,
                   c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2,
                   TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, LAYOUT: tl.constexpr, BOUNDED: tl.constexpr):
    """K transposed (`[chunk, BLOCK_N]`) and V (`[BLOCK_N, chunk]`) of the box tile whose first keys are
    (key0, key1, key2), per column chunk (`k_a, v_a, k_b, v_b`; the second pair is the first again when CHUNK_B
    is 0). `BOUNDED`: some key may lie past the group's end (gathers then skip it; loop 1's tiles never hold
    one)."""
    k_a, v_a = _load_box_chunk(key0, key1, key2, k_desc_a, v_desc_a, K_head, V_head, stride_kn, stride_vn,
                               c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2, TK0, TK1, TK2, HEAD_DIM, 0, CHUNK_A,
                               LAYOUT, BOUNDED)
    k_b, v_b = k_a, v_a
    if CHUNK_B > 0:
        k_b, v_b = _load_box_chunk(key0, key1, key2, k_desc_b, v_desc_b, K_head, V_head, stride_kn, stride_vn,
                                   c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2, TK0, TK1, TK2, HEAD_DIM,
                                   CHUNK_A, CHUNK_B, LAYOUT, BOUNDED)
    return k_a, v_a, k_b, v_b


@triton.jit
def gna_dynamic_kernel(
    Q, K, V, O, LSE, COUNTS,
    stride_qb, stride_q0, stride_q1, stride_q2, stride_qh,
    stride_kb, stride_k0, stride_k1, stride_k2, stride_kh,
    stride_vb, stride_v0, stride_v1, stride_v2, stride_vh,
    stride_ob, stride_o0, stride_o1, stride_o2, stride_oh,
    heads, qk_scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, WRITE_LSE: tl.constexpr,
    DEBUG: tl.constexpr, MASKED: tl.constexpr = True, USE_TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False, LAYOUT: tl.constexpr = 0,
):
    """Same arguments as `gna_forward_kernel` (kernels/gna/forward.py); `USE_TMA` only matters for LAYOUT 0's Q and O
    (K and V are gathered there), and `WARP_SPECIALIZE` applies to loop 1."""
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    q_tile, bh, num_q_tiles, b, h = program_tile(heads, HEAD_MAJOR)

    group, gi0, gi1, gi2, len0, len1, len2, i0, i1, i2 = tile_in_group(q_tile, L0, L1, L2, D0, D1, D2,
                                                                        NQ0, NQ1, NQ2)
    first0 = i0 * TQ0
    first1 = i1 * TQ1
    first2 = i2 * TQ2
    real_tile = (first0 < len0) & (first1 < len1) & (first2 < len2)

    o0, n0, f0, g0, sl0, ef0 = _box(first0, len0, W0, S0, C0, TQ0, TK0)
    o1, n1, f1, g1, sl1, ef1 = _box(first1, len1, W1, S1, C1, TQ1, TK1)
    o2, n2, f2, g2, sl2, ef2 = _box(first2, len2, W2, S2, C2, TQ2, TK2)
    num_kv = tl.where(real_tile, n0 * n1 * n2, 0)
    c0, c1, c2 = tile_coordinates(TK0, TK1, TK2)
    kv_group = group * (NK0 * NK1 * NK2)
    q_row0 = q_tile * BLOCK_M
    K_head = K + b * stride_kb + h * stride_kh
    V_head = V + b * stride_vb + h * stride_vh
    if LAYOUT == 2:
        q_rows = L2
    else:
        q_rows = num_q_tiles * BLOCK_M
    q_a, q_b = load_q_tile(Q + b * stride_qb + h * stride_qh, stride_q0, stride_q1, stride_q2, L0, L1, L2,
                           first0, first1, first2, q_row0, q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B,
                           USE_TMA, LAYOUT)
    # K and V: descriptors in place; on the permuted path box tiles are gathered through pointers.
    k_desc_a, v_desc_a, k_desc_b, v_desc_b = kv_descriptors(
        K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, L0, L1, L2, L2,
        TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, False, LAYOUT)

    acc_a = tl.zeros([BLOCK_M, CHUNK_A], dtype=tl.float32)
    acc_b = acc_a  # one accumulator per column chunk; the first again, never updated, without a second chunk
    if CHUNK_B > 0:
        acc_b = tl.zeros([BLOCK_M, CHUNK_B], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    unmasked = num_kv * 0

    # Loop 1: the full box tiles, a sub-box [f0, g0) x [f1, g1) x [f2, g2) of the box; no mask code. Without
    # MASKED every box tile is full and inside the group.
    if MASKED:
        g0, num_full = inner_box(f0, g0, f1, g1, f2, g2, real_tile)
    else:
        f0, g0, f1, g1, f2, g2 = n0 * 0, n0, n1 * 0, n1, n2 * 0, n2
        num_full = num_kv
    m0 = f0
    m1 = f1
    m2 = f2
    for _ in tl.range(0, num_full, warp_specialize=WARP_SPECIALIZE):
        key0 = o0 + m0 * TK0
        key1 = o1 + m1 * TK1
        key2 = o2 + m2 * TK2
        k_a, v_a, k_b, v_b = _load_box_tile(key0, key1, key2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, K_head,
                                            V_head, stride_k2, stride_v2, c0, c1, c2, kv_group, len0, len1, len2,
                                            NK1, NK2, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, LAYOUT, False)
        qk = chunked_dot(q_a, q_b, k_a, k_b, CHUNK_B)
        acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
        if DEBUG:
            unmasked += is_full(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2, TK0, TK1, TK2)
        m0, m1, m2 = next_tile(m0, m1, m2, f1, g1, f2, g2)

    # Loop 2: every other box tile under the element mask (window; keys past the group's end fall outside
    # every window, and read as zeros or are not read at all).
    if MASKED:
        qs0, w0, qs1, w1, qs2, w2 = row_windows(first0, first1, first2, len0, len1, len2, W0, W1, W2, S0, S1, S2,
                                                C0, C1, C2, TQ0, TQ1, TQ2)
        zero = n0 * 0
        for j in tl.range(0, num_kv - num_full):
            m0, m1, m2 = slab_tile(j, zero, n0, zero, n1, zero, n2, f0, g0, f1, g1, f2, g2)
            key0 = o0 + m0 * TK0
            key1 = o1 + m1 * TK1
            key2 = o2 + m2 * TK2
            k_a, v_a, k_b, v_b = _load_box_tile(key0, key1, key2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, K_head,
                                                V_head, stride_k2, stride_v2, c0, c1, c2, kv_group, len0, len1,
                                                len2, NK1, NK2, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, LAYOUT,
                                                True)
            qk = chunked_dot(q_a, q_b, k_a, k_b, CHUNK_B)
            keep = in_windows(qs0, w0, qs1, w1, qs2, w2, key0 + c0, key1 + c1, key2 + c2, False)
            qk = tl.where(keep, qk, float("-inf"))
            acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
            if DEBUG:
                unmasked += is_full(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2,
                                    TK0, TK1, TK2)

    store_output(O + b * stride_ob + h * stride_oh, LSE, acc_a, acc_b, l_i, m_i, b, h, heads, stride_o0, stride_o1,
                 stride_o2, L0, L1, L2, first0, first1, first2, q_row0, q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A,
                 CHUNK_B, WRITE_LSE, USE_TMA, LAYOUT)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * q_tile, num_kv)
            tl.store(COUNTS + 2 * q_tile + 1, unmasked)
