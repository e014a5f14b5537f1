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

from ..common.softmax import softmax_step
from .geometry import layout_descriptor, tile_in_group, window_bounds


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
def _full_keys(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2,
               TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """1 when every real query attends every real key of the box tile whose first keys are (key0, key1,
    key2), else 0: the simulator's definition of a full tile (DEBUG)."""
    full = (sl0 <= key0) & (ef0 >= tl.minimum(key0 + TK0, len0))
    full &= (sl1 <= key1) & (ef1 >= tl.minimum(key1 + TK1, len1))
    full &= (sl2 <= key2) & (ef2 >= tl.minimum(key2 + TK2, len2))
    return tl.where(full, 1, 0)


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
def _load_box_tile(key0, key1, key2, k_desc, v_desc, K_head, V_head, stride_kn, stride_vn,
                   c0, c1, c2, dims, kv_group, len0, len1, len2, NK1, NK2,
                   TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   LAYOUT: tl.constexpr, BOUNDED: tl.constexpr):
    """K transposed (`[head_dim, BLOCK_N]`) and V (`[BLOCK_N, head_dim]`) of the box tile whose first keys are
    (key0, key1, key2). `BOUNDED`: some key may lie past the group's end (gathers then skip it; loop 1's tiles
    never hold one)."""
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if LAYOUT == 1:
        corner = [key0, key1, key2, 0]
        k = k_desc.load(corner).reshape([BLOCK_N, HEAD_DIM]).T
        v = v_desc.load(corner).reshape([BLOCK_N, HEAD_DIM])
    elif LAYOUT == 2:
        k = k_desc.load([key2, 0]).T
        v = v_desc.load([key2, 0])
    else:
        position, inside = _gather_offsets(key0, key1, key2, c0, c1, c2, kv_group, len0, len1, len2, NK1, NK2,
                                           TK0, TK1, TK2)
        k_ptrs = K_head + position[None, :] * stride_kn + dims[:, None]
        v_ptrs = V_head + position[:, None] * stride_vn + dims[None, :]
        if BOUNDED:
            k = tl.load(k_ptrs, mask=inside[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=inside[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _slab_tile(j, n0, n1, n2, f0, g0, f1, g1, f2, g2):
    """The j-th box tile outside the full sub-box [f0, g0) x [f1, g1) x [f2, g2) of an n0 x n1 x n2 box: six
    slabs, below / above the full run along dimension 0, then inside it along 1, then inside both along 2."""
    m0 = g0 - f0
    m1 = g1 - f1
    size_a = f0 * n1 * n2
    size_b = (n0 - g0) * n1 * n2
    size_c = m0 * f1 * n2
    size_d = m0 * (n1 - g1) * n2
    size_e = m0 * m1 * f2
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
    a0 = tl.where(in_a, 0, tl.where(in_b, g0, f0))
    a1 = tl.where(in_a | in_b | in_c, 0, tl.where(in_d, g1, f1))
    a2 = tl.where(in_a | in_b | in_c | in_d | in_e, 0, g2)
    e1 = tl.where(in_a | in_b, n1, tl.where(in_c, f1, tl.where(in_d, n1 - g1, m1)))
    e2 = tl.where(in_a | in_b | in_c | in_d, n2, tl.where(in_e, f2, n2 - g2))
    r2 = r // e2
    r1 = r2 // e1
    return a0 + r1, a1 + (r2 - r1 * e1), a2 + (r - r2 * e2)


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
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DEBUG: tl.constexpr,
    MASKED: tl.constexpr = True, USE_TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False, LAYOUT: tl.constexpr = 0,
):
    """Same arguments as `gna_forward_kernel` (kernels/gna/forward.py); `USE_TMA` only matters for LAYOUT 0's Q and O
    (K and V are gathered there), and `WARP_SPECIALIZE` applies to loop 1."""
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if HEAD_MAJOR:
        q_tile = tl.program_id(1)
        bh = tl.program_id(0)
        num_q_tiles = tl.num_programs(1)
    else:
        q_tile = tl.program_id(0)
        bh = tl.program_id(1)
        num_q_tiles = tl.num_programs(0)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)

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
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_group = group * (NK0 * NK1 * NK2)
    q_row0 = q_tile * BLOCK_M
    qs0, qe0 = window_bounds(first0 + rows // (TQ1 * TQ2), len0, W0, S0, C0)
    qs1, qe1 = window_bounds(first1 + (rows // TQ2) % TQ1, len1, W1, S1, C1)
    qs2, qe2 = window_bounds(first2 + rows % TQ2, len2, W2, S2, C2)
    c0 = cols // (TK1 * TK2)
    c1 = (cols // TK2) % TK1
    c2 = cols % TK2
    K_head = K + b * stride_kb + h * stride_kh
    V_head = V + b * stride_vb + h * stride_vh
    if LAYOUT == 2:
        q_rows = L2
    else:
        q_rows = num_q_tiles * BLOCK_M
    if LAYOUT == 1:
        q_desc = layout_descriptor(Q + b * stride_qb + h * stride_qh, L0, L1, L2, stride_q0, stride_q1, stride_q2,
                                    TQ0, TQ1, TQ2, HEAD_DIM)
        k_desc = layout_descriptor(K_head, L0, L1, L2, stride_k0, stride_k1, stride_k2, TK0, TK1, TK2, HEAD_DIM)
        v_desc = layout_descriptor(V_head, L0, L1, L2, stride_v0, stride_v1, stride_v2, TK0, TK1, TK2, HEAD_DIM)
        q = q_desc.load([first0, first1, first2, 0]).reshape([BLOCK_M, HEAD_DIM])
    elif LAYOUT == 2:
        q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[q_rows, HEAD_DIM],
                                           strides=[stride_q2, 1], block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K_head, shape=[L2, HEAD_DIM], strides=[stride_k2, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V_head, shape=[L2, HEAD_DIM], strides=[stride_v2, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        q = q_desc.load([q_row0, 0])
    else:
        k_desc = K  # unused: box tiles are gathered through pointers
        v_desc = V
        if USE_TMA:
            q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[q_rows, HEAD_DIM],
                                               strides=[stride_q2, 1], block_shape=[BLOCK_M, HEAD_DIM])
            q = q_desc.load([q_row0, 0])
        else:
            q_ptrs = Q + b * stride_qb + h * stride_qh + (q_row0 + rows).to(tl.int64)[:, None] * stride_q2
            q = tl.load(q_ptrs + dims[None, :])

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    unmasked = num_kv * 0

    # Loop 1: the full box tiles, a sub-box [f0, g0) x [f1, g1) x [f2, g2) of the box; no mask code. Without
    # MASKED every box tile is full and inside the group.
    if MASKED:
        empty = (g0 == f0) | (g1 == f1) | (g2 == f2)
        g0 = tl.where(empty, f0, g0)  # no full tile: loop 2 (slabs below / above f0) covers the whole box
        num_full = tl.where(real_tile, (g0 - f0) * (g1 - f1) * (g2 - f2), 0)
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
        k, v = _load_box_tile(key0, key1, key2, k_desc, v_desc, K_head, V_head, stride_k2, stride_v2,
                              c0, c1, c2, dims, kv_group, len0, len1, len2, NK1, NK2,
                              TK0, TK1, TK2, HEAD_DIM, LAYOUT, False)
        qk = tl.dot(q, k)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale)
        if DEBUG:
            unmasked += _full_keys(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2, TK0, TK1, TK2)
        m2 += 1
        wrap2 = m2 == g2
        m2 = tl.where(wrap2, f2, m2)
        m1 += tl.where(wrap2, 1, 0)
        wrap1 = m1 == g1
        m1 = tl.where(wrap1, f1, m1)
        m0 += tl.where(wrap1, 1, 0)

    # Loop 2: every other box tile under the element mask (window; keys past the group's end fall outside
    # every window, and read as zeros or are not read at all).
    if MASKED:
        w0 = (qe0 - qs0).to(tl.uint32)
        w1 = (qe1 - qs1).to(tl.uint32)
        w2 = (qe2 - qs2).to(tl.uint32)
        for j in tl.range(0, num_kv - num_full):
            m0, m1, m2 = _slab_tile(j, n0, n1, n2, f0, g0, f1, g1, f2, g2)
            key0 = o0 + m0 * TK0
            key1 = o1 + m1 * TK1
            key2 = o2 + m2 * TK2
            k, v = _load_box_tile(key0, key1, key2, k_desc, v_desc, K_head, V_head, stride_k2, stride_v2,
                                  c0, c1, c2, dims, kv_group, len0, len1, len2, NK1, NK2,
                                  TK0, TK1, TK2, HEAD_DIM, LAYOUT, True)
            qk = tl.dot(q, k)
            keep = (c0[None, :] - (qs0 - key0)[:, None]).to(tl.uint32) < w0[:, None]
            keep &= (c1[None, :] - (qs1 - key1)[:, None]).to(tl.uint32) < w1[:, None]
            keep &= (c2[None, :] - (qs2 - key2)[:, None]).to(tl.uint32) < w2[:, None]
            qk = tl.where(keep, qk, float("-inf"))
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale)
            if DEBUG:
                unmasked += _full_keys(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2,
                                       TK0, TK1, TK2)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    if LAYOUT == 1:
        o_desc = layout_descriptor(O + b * stride_ob + h * stride_oh, L0, L1, L2, stride_o0, stride_o1, stride_o2,
                                    TQ0, TQ1, TQ2, HEAD_DIM)
        o_desc.store([first0, first1, first2, 0], out.reshape([TQ0, TQ1, TQ2, HEAD_DIM]))
    elif LAYOUT == 2 or USE_TMA:
        o_desc = tl.make_tensor_descriptor(O + b * stride_ob + h * stride_oh, shape=[q_rows, HEAD_DIM],
                                           strides=[stride_o2, 1], block_shape=[BLOCK_M, HEAD_DIM])
        o_desc.store([q_row0, 0], out)
    else:
        o_ptrs = O + b * stride_ob + h * stride_oh + (q_row0 + rows).to(tl.int64)[:, None] * stride_o2
        tl.store(o_ptrs + dims[None, :], out)
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        if LAYOUT == 1:
            x0 = first0 + rows // (TQ1 * TQ2)
            x1 = first1 + (rows // TQ2) % TQ1
            x2 = first2 + rows % TQ2
            tokens = ((x0 * L1 + x1) * L2 + x2).to(tl.int64)
            real = (x0 < L0) & (x1 < L1) & (x2 < L2)
            tl.store(LSE + (b * L0 * L1 * L2 + tokens) * heads + h, lse, mask=real)
        else:
            tokens = (q_row0 + rows).to(tl.int64)
            tl.store(LSE + (b * q_rows + tokens) * heads + h, lse, mask=tokens < q_rows)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * q_tile, num_kv)
            tl.store(COUNTS + 2 * q_tile + 1, unmasked)
