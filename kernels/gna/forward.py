"""The GNA forward kernel (multi-D tiles, static KV tiling); its launcher is kernels/gna/launch.py.

One program handles one Q tile of one (batch, head). It finds its own KV tiles from the GNA parameters with
`window_bounds` (kernels/gna/geometry.py), per dimension: from `start(first query) // T_KV` to
`ceil(end(last query) / T_KV) - 1`, where first/last are the tile's first and last real queries. It never
reads a precomputed block list, so its tile counts can be held against natsim's simulator.

A visited KV tile is full when every real query attends every real key (per dimension `start(last query) <=
first key` and `end(first query) >= last real key + 1`). Per dimension the full tiles without padding keys
are one run of the visited range, so the full tiles form a box inside the visited box, and the kernel runs
two KV loops:

1. over that full box, with no mask code at all;
2. over the rest of the visited box (six slabs: below / above the full run along dimension 0, then inside it
   along dimension 1, then along dimension 2), each tile under the element mask. Windows end inside their
   group, so the window test (one unsigned compare per dimension) also drops padding keys.

Triton gives each loop its own pipelined shared-memory buffers but reuses them between the loops, so a
128x128x128 tile still fits three K/V stages. Two loops replace an earlier single loop that chose per tile
between the masked and the unmasked path: a branch that yields the scores made Triton's layout pass compute
the exponentials twice (once per register layout), doubling the MUFU work of every tile, and a branch that
yields a boolean mask cost more than it saved (packing and unpacking predicates; 115 ms against 91 ms at
HunyuanVideo stride 1x1x1 on the H100). With DEBUG on, both loops count the tiles that pass
the full-tile test, so the per-Q-tile counts are still the kernel's own decisions.

Compile-time switches (the launcher sets them, kernels/gna/launch.py):

- `MASKED`: some visited tile may be partial or padded. The launcher works this out on the host per
  dimension (`needs_mask`); when it is False (dense attention and block-sparse configurations) only loop 1
  is compiled, over the whole visited box.
- `USE_TMA`: Q, K, V and O move through tensor descriptors made in the kernel (the Hopper bulk tensor copy
  engine) instead of pointer tensors, which also frees the registers that held 128x128 pointer tiles.
  Pointer loads remain for GPUs before Hopper and for unaligned strides. The interpreter runs both.
- `WARP_SPECIALIZE`: loop 1 as a warp-specialized `tl.range` (producer warpgroup for the copies).
- `HEAD_MAJOR`: grid over (batch * heads, Q tiles) instead of (Q tiles, batch * heads) (tuning only; slower).
- `LAYOUT`: where q, k, v and o live. 0: permuted sequences `[B, tokens, H, D]` (kernels/gna/permute.py), every
  dilation group padded to whole tiles; a tile is a run of tokens. 1: the caller's `[B, L0, L1, L2, H, D]`
  read in place through rank-4 descriptors, a tile a box of the layout whose padding lies out of bounds (read
  as zeros, stores dropped); no dilation. 2: a 1-D layout in place through the rank-2 descriptors of mode 0
  over its real rows. Triton 3.6 cannot warp-specialize a loop that loads through rank-4 descriptors, so the
  launcher uses mode 1 without `WARP_SPECIALIZE`.

Frame ranges (natsim.distributed's halo exchange): q and o may hold frames `[Q0_OFF, Q0_OFF + L0)` of
dimension 0 of a layout of `G0` frames, and k, v frames `[K0_OFF, K0_OFF + KL0)` holding every frame those
queries attend. Window bounds along dimension 0 are the global layout's (`frame_groups`: a local dilation group
is a run of a global one, and key groups may be rotated against query groups); Q and KV tiles are cut from the
local first frames. A whole layout has offsets 0 and `G0 == KL0 == L0`, and the kernel is what it was.

The softmax scale (times log2 e) is applied with one fused multiply-add per score (`qk * scale - m`), the
running maximum is kept in scaled units, and the online-softmax recurrence is the usual flash-attention one
in base 2 with fp32 accumulators. Kernels always see three dimensions (kernels/gna/layout.py): a 1-D or 2-D
problem has leading dimensions of length 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.softmax import LOG2E, softmax_step
from .geometry import dim_setup, frame_groups, full_run, is_full, layout_descriptor, tile_in_group, window_bounds


@triton.jit
def _load_kv(tile, k0, k1, k2, k_desc, v_desc, k_base, v_base, stride_kn, stride_vn,
             TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
             USE_TMA: tl.constexpr, LAYOUT: tl.constexpr):
    """K transposed (`[head_dim, BLOCK_N]`) and V (`[BLOCK_N, head_dim]`) of KV tile (k0, k1, k2), linear index
    `tile` in the permuted order: a box of the token layout through rank-4 descriptors (LAYOUT 1), a run of
    the sequence through rank-2 descriptors, or pointer tiles `k_base` / `v_base`."""
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if LAYOUT == 1:
        corner = [k0 * TK0, k1 * TK1, k2 * TK2, 0]
        k = k_desc.load(corner).reshape([BLOCK_N, HEAD_DIM]).T
        v = v_desc.load(corner).reshape([BLOCK_N, HEAD_DIM])
    elif USE_TMA:
        k = k_desc.load([tile * BLOCK_N, 0]).T
        v = v_desc.load([tile * BLOCK_N, 0])
    else:
        offset = (tile * BLOCK_N).to(tl.int64)
        k = tl.load(k_base + offset * stride_kn)
        v = tl.load(v_base + offset * stride_vn)
    return k, v


@triton.jit(do_not_specialize=["G0", "KL0", "Q0_OFF", "K0_OFF"])  # frame offsets: one compile for every rank
def gna_forward_kernel(
    Q, K, V, O, LSE, COUNTS,
    stride_qb, stride_q0, stride_q1, stride_q2, stride_qh,
    stride_kb, stride_k0, stride_k1, stride_k2, stride_kh,
    stride_vb, stride_v0, stride_v1, stride_v2, stride_vh,
    stride_ob, stride_o0, stride_o1, stride_o2, stride_oh,
    heads, qk_scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2,
    G0, KL0, Q0_OFF, K0_OFF,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DEBUG: tl.constexpr,
    MASKED: tl.constexpr = True, USE_TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False, LAYOUT: tl.constexpr = 0,
):
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if HEAD_MAJOR:  # grid (batch * heads, Q tiles): program ids run over heads first
        q_tile = tl.program_id(1)
        bh = tl.program_id(0)
        num_q_tiles = tl.num_programs(1)
    else:  # grid (Q tiles, batch * heads)
        q_tile = tl.program_id(0)
        bh = tl.program_id(1)
        num_q_tiles = tl.num_programs(0)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)

    # Which dilation group and which tile of the group this program holds.
    group, gi0, gi1, gi2, len0, len1, len2, i0, i1, i2 = tile_in_group(q_tile, L0, L1, L2, D0, D1, D2,
                                                                         NQ0, NQ1, NQ2)
    first0 = i0 * TQ0
    first1 = i1 * TQ1
    first2 = i2 * TQ2
    real_tile = (first0 < len0) & (first1 < len1) & (first2 < len2)

    qo0, glen0, kg0, ko0, klen0 = frame_groups(gi0, G0, KL0, Q0_OFF, K0_OFF, D0)  # frame range, dim 0

    sl0, ef0, lo0, hi0 = dim_setup(first0, len0, glen0, qo0, ko0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, lo1, hi1 = dim_setup(first1, len1, len1, 0, 0, W1, S1, C1, TQ1, TK1)
    sl2, ef2, lo2, hi2 = dim_setup(first2, len2, len2, 0, 0, W2, S2, C2, TQ2, TK2)
    num_kv = tl.where(real_tile, (hi0 - lo0) * (hi1 - lo1) * (hi2 - lo2), 0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_tiles_per_group = NK0 * NK1 * NK2
    kv_group = ((kg0 * D1 + gi1) * D2 + gi2) * kv_tiles_per_group  # group index, kg0 == gi0 but for frames
    q_row0 = q_tile * BLOCK_M
    # Per-row window bounds (in-group coordinates) and per-column key offsets inside a KV tile.
    qs0, qe0 = window_bounds(qo0 + first0 + rows // (TQ1 * TQ2), glen0, W0, S0, C0)
    qs0 -= ko0
    qe0 -= ko0
    qs1, qe1 = window_bounds(first1 + (rows // TQ2) % TQ1, len1, W1, S1, C1)
    qs2, qe2 = window_bounds(first2 + rows % TQ2, len2, W2, S2, C2)
    c0 = cols // (TK1 * TK2)
    c1 = (cols // TK2) % TK1
    c2 = cols % TK2
    if LAYOUT == 2:  # a 1-D layout read in place: rows past its end read zeros, stores there are dropped
        q_rows = L2
        kv_rows = L2
    else:  # permuted sequences: every group padded to whole tiles
        q_rows = num_q_tiles * BLOCK_M
        kv_rows = D0 * D1 * D2 * kv_tiles_per_group * BLOCK_N
    if LAYOUT == 1:  # q, k, v, o are [B, L0, L1, L2, heads, head_dim]: tiles are boxes, padding is out of bounds
        q_desc = layout_descriptor(Q + b * stride_qb + h * stride_qh, L0, L1, L2, stride_q0, stride_q1, stride_q2,
                                    TQ0, TQ1, TQ2, HEAD_DIM)
        k_desc = layout_descriptor(K + b * stride_kb + h * stride_kh, KL0, L1, L2, stride_k0, stride_k1, stride_k2,
                                    TK0, TK1, TK2, HEAD_DIM)
        v_desc = layout_descriptor(V + b * stride_vb + h * stride_vh, KL0, L1, L2, stride_v0, stride_v1, stride_v2,
                                    TK0, TK1, TK2, HEAD_DIM)
        q = q_desc.load([first0, first1, first2, 0]).reshape([BLOCK_M, HEAD_DIM])
        k_base = K  # unused: loads go through the descriptors
        v_base = V
    elif USE_TMA:  # [B, tokens, heads, head_dim]: tiles are runs of BLOCK_M / BLOCK_N tokens
        q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[q_rows, HEAD_DIM],
                                           strides=[stride_q2, 1], block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[kv_rows, HEAD_DIM],
                                           strides=[stride_k2, 1], block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[kv_rows, HEAD_DIM],
                                           strides=[stride_v2, 1], block_shape=[BLOCK_N, HEAD_DIM])
        q = q_desc.load([q_row0, 0])
        k_base = K  # unused: loads go through the descriptors
        v_base = V
    else:
        q_ptrs = Q + b * stride_qb + h * stride_qh + (q_row0 + rows).to(tl.int64)[:, None] * stride_q2
        q = tl.load(q_ptrs + dims[None, :])
        k_base = K + b * stride_kb + h * stride_kh + cols.to(tl.int64)[None, :] * stride_k2 + dims[:, None]
        v_base = V + b * stride_vb + h * stride_vh + cols.to(tl.int64)[:, None] * stride_v2 + dims[None, :]
        k_desc = K  # unused: loads go through the pointers
        v_desc = V

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    unmasked = num_kv * 0

    # Loop 1: the full KV tiles, a box [f0, g0) x [f1, g1) x [f2, g2) inside the visited box (per dimension the
    # full, unpadded tiles are one run); no mask code. Without MASKED the visited box is all full.
    if MASKED:
        f0, g0 = full_run(sl0, ef0, lo0, hi0, TK0)
        f1, g1 = full_run(sl1, ef1, lo1, hi1, TK1)
        f2, g2 = full_run(sl2, ef2, lo2, hi2, TK2)
        empty = (g0 == f0) | (g1 == f1) | (g2 == f2)
        g0 = tl.where(empty, f0, g0)  # no full tile: loop 2 (slab below/above f0) covers the whole box
        num_full = tl.where(real_tile, (g0 - f0) * (g1 - f1) * (g2 - f2), 0)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_kv
    k0 = f0
    k1 = f1
    k2 = f2
    for _ in tl.range(0, num_full, warp_specialize=WARP_SPECIALIZE):
        tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
        k, v = _load_kv(tile, k0, k1, k2, k_desc, v_desc, k_base, v_base, stride_k2, stride_v2,
                            TK0, TK1, TK2, HEAD_DIM, USE_TMA, LAYOUT)
        qk = tl.dot(q, k)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale)
        if DEBUG:
            unmasked += is_full(k0, k1, k2, sl0, ef0, sl1, ef1, sl2, ef2, klen0, len1, len2, TK0, TK1, TK2)
        # Next KV tile: step the last dimension, carry into the ones before it.
        k2 += 1
        wrap2 = k2 == g2
        k2 = tl.where(wrap2, f2, k2)
        k1 += tl.where(wrap2, 1, 0)
        wrap1 = k1 == g1
        k1 = tl.where(wrap1, f1, k1)
        k0 += tl.where(wrap1, 1, 0)

    # Loop 2: every other visited tile, each under the element mask (window and padding keys). The visited box
    # minus the full box is six slabs: below / above the full run along dimension 0 (whole extent of 1 and
    # 2), then inside [f0, g0) below / above it along dimension 1, then inside [f0, g0) x [f1, g1) along 2.
    if MASKED:
        # Per-row windows as (start, width) for one unsigned compare per dimension.
        w0 = (qe0 - qs0).to(tl.uint32)
        w1 = (qe1 - qs1).to(tl.uint32)
        w2 = (qe2 - qs2).to(tl.uint32)
        n1 = hi1 - lo1
        n2 = hi2 - lo2
        m0 = g0 - f0
        m1 = g1 - f1
        size_a = (f0 - lo0) * n1 * n2
        size_b = (hi0 - g0) * n1 * n2
        size_c = m0 * (f1 - lo1) * n2
        size_d = m0 * (hi1 - g1) * n2
        size_e = m0 * m1 * (f2 - lo2)
        for j in tl.range(0, num_kv - num_full):
            # Which slab holds the j-th partial tile: its origin (a0, a1, a2) and extents (e1, e2).
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
            k0 = a0 + r1
            k1 = a1 + (r2 - r1 * e1)
            k2 = a2 + (r - r2 * e2)
            tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
            k, v = _load_kv(tile, k0, k1, k2, k_desc, v_desc, k_base, v_base, stride_k2, stride_v2,
                            TK0, TK1, TK2, HEAD_DIM, USE_TMA, LAYOUT)
            qk = tl.dot(q, k)
            # Key k0 * TK0 + c0 is in row r's window [qs0, qs0 + w0) iff c0 - (qs0 - k0 * TK0) < w0 unsigned;
            # windows end inside the group, so padding keys fall outside every one.
            keep = (c0[None, :] - (qs0 - k0 * TK0)[:, None]).to(tl.uint32) < w0[:, None]
            keep &= (c1[None, :] - (qs1 - k1 * TK1)[:, None]).to(tl.uint32) < w1[:, None]
            keep &= (c2[None, :] - (qs2 - k2 * TK2)[:, None]).to(tl.uint32) < w2[:, None]
            qk = tl.where(keep, qk, float("-inf"))
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale)
            if DEBUG:
                unmasked += is_full(k0, k1, k2, sl0, ef0, sl1, ef1, sl2, ef2, klen0, len1, len2, TK0, TK1, TK2)

    # Padding queries (and only they) can end with no key at all: give them zeros, not 0 / 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    if LAYOUT == 1:
        o_desc = layout_descriptor(O + b * stride_ob + h * stride_oh, L0, L1, L2, stride_o0, stride_o1, stride_o2,
                                    TQ0, TQ1, TQ2, HEAD_DIM)
        o_desc.store([first0, first1, first2, 0], out.reshape([TQ0, TQ1, TQ2, HEAD_DIM]))
    elif USE_TMA:
        o_desc = tl.make_tensor_descriptor(O + b * stride_ob + h * stride_oh, shape=[q_rows, HEAD_DIM],
                                           strides=[stride_o2, 1], block_shape=[BLOCK_M, HEAD_DIM])
        o_desc.store([q_row0, 0], out)
    else:
        o_ptrs = O + b * stride_ob + h * stride_oh + (q_row0 + rows).to(tl.int64)[:, None] * stride_o2
        tl.store(o_ptrs + dims[None, :], out)
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        if LAYOUT == 1:  # [B, L0, L1, L2, heads], padding rows dropped
            x0 = first0 + rows // (TQ1 * TQ2)
            x1 = first1 + (rows // TQ2) % TQ1
            x2 = first2 + rows % TQ2
            tokens = ((x0 * L1 + x1) * L2 + x2).to(tl.int64)
            real = (x0 < L0) & (x1 < L1) & (x2 < L2)
            tl.store(LSE + (b * L0 * L1 * L2 + tokens) * heads + h, lse, mask=real)
        else:  # [B, q_rows, heads]
            tokens = (q_row0 + rows).to(tl.int64)
            tl.store(LSE + (b * q_rows + tokens) * heads + h, lse, mask=tokens < q_rows)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * q_tile, num_kv)
            tl.store(COUNTS + 2 * q_tile + 1, unmasked)
