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
   below / above along dimension 1, then along dimension 2; `slab_tile`), each tile under the element mask.
   Windows end inside their group, so the window test (one unsigned compare per dimension) also drops padding
   keys.

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
- `LAYOUT`: where q, k, v and o live (kernels/gna/tile_io.py): 0 permuted sequences, every dilation group
  padded to whole tiles; 1 the caller's layout in place through rank-4 descriptors (no dilation); 2 a 1-D
  layout in place. Triton 3.6 cannot warp-specialize a loop that loads through rank-4 descriptors, so the
  launcher uses mode 1 without `WARP_SPECIALIZE`.

Frame ranges (natsim.distributed's halo exchange): q and o may hold frames `[Q0_OFF, Q0_OFF + L0)` of
dimension 0 of a layout of `G0` frames, and k, v frames `[K0_OFF, K0_OFF + KL0)` holding every frame those
queries attend. Window bounds along dimension 0 are the global layout's (`frame_groups`: a local dilation group
is a run of a global one, and key groups may be rotated against query groups); Q and KV tiles are cut from the
local first frames. A whole layout has offsets 0 and `G0 == KL0 == L0`, and the kernel is what it was.

head_dim runs in power-of-two column chunks (kernels/common/headdim.py: `CHUNK_A`, then `CHUNK_B` where that is
not 0, the last masked past head_dim): Q, K and V tiles move per chunk (tile_io.py), scores sum the chunks'
products (`chunked_dot`) and P @ V keeps one accumulator per chunk (`softmax_step`); without a second chunk its
code is not compiled and the kernel is the one-chunk kernel it was.

The softmax scale (times log2 e) is applied with one fused multiply-add per score (`qk * scale - m`), the
running maximum is kept in scaled units, and the online-softmax recurrence is the usual flash-attention one
in base 2 with fp32 accumulators. Kernels always see three dimensions (kernels/gna/layout.py): a 1-D or 2-D
problem has leading dimensions of length 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.fp8 import value_scales
from ..common.headdim import chunk_columns, chunked_dot, load_columns
from ..common.softmax import softmax_step, softmax_step_fp8
from .geometry import (dim_setup, frame_groups, full_run, in_windows, inner_box, is_full, next_tile, row_windows,
                       slab_tile, tile_coordinates, tile_in_group)
from .tile_io import key_scales, kv_descriptors, load_q_tile, program_tile, store_output


@triton.jit
def _load_kv_chunk(tile, k0, k1, k2, k_desc, v_desc, k_rows, v_rows, stride_kn, stride_vn,
                   TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   OFFSET: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr,
                   FP8: tl.constexpr):
    """Columns `[OFFSET, OFFSET + WIDTH)` of `_load_kv`'s K and V tiles, zeros past head_dim (without
    descriptors, `k_desc` / `v_desc` are the head's bare pointers)."""
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if LAYOUT == 1:
        corner = [k0 * TK0, k1 * TK1, k2 * TK2, OFFSET]
        k = k_desc.load(corner).reshape([BLOCK_N, WIDTH]).T
        v = v_desc.load(corner).reshape([BLOCK_N, WIDTH])
    elif USE_TMA:
        k = k_desc.load([tile * BLOCK_N, OFFSET]).T
        if FP8:
            v = v_desc.load([OFFSET, tile * BLOCK_N]).T
        else:
            v = v_desc.load([tile * BLOCK_N, OFFSET])
    else:
        offset = (tile * BLOCK_N).to(tl.int64)
        k = load_columns(k_desc, k_rows + offset * stride_kn, OFFSET, WIDTH, HEAD_DIM, TRANSPOSED=True)
        if FP8:  # V transposed: a key's channels lie `stride_vn` apart
            channels = chunk_columns(OFFSET, WIDTH)
            v_ptrs = v_desc + (v_rows[:, None] + offset + channels[None, :].to(tl.int64) * stride_vn)
            if OFFSET + WIDTH > HEAD_DIM:
                v = tl.load(v_ptrs, mask=(channels < HEAD_DIM)[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs)
        else:
            v = load_columns(v_desc, v_rows + offset * stride_vn, OFFSET, WIDTH, HEAD_DIM)
    return k, v


@triton.jit
def _load_kv(tile, k0, k1, k2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, k_rows, v_rows, stride_kn, stride_vn,
             TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, HEAD_DIM: tl.constexpr,
             CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr,
             FP8: tl.constexpr):
    """K transposed (`[chunk, BLOCK_N]`) and V (`[BLOCK_N, chunk]`) of KV tile (k0, k1, k2), linear index `tile`
    in the permuted order, per column chunk (`k_a, v_a, k_b, v_b`; the second pair is the first again when
    CHUNK_B is 0): a box of the token layout through rank-4 descriptors (LAYOUT 1), a run of the sequence through
    rank-2 descriptors, or pointer loads at `k_rows` / `v_rows` (element offsets of the first tile's keys). With FP8, V
    is stored transposed (`[head_dim, rows]`, kernels/common/fp8.py) and `stride_vn` is its row length."""
    k_a, v_a = _load_kv_chunk(tile, k0, k1, k2, k_desc_a, v_desc_a, k_rows, v_rows, stride_kn, stride_vn,
                              TK0, TK1, TK2, HEAD_DIM, 0, CHUNK_A, USE_TMA, LAYOUT, FP8)
    k_b, v_b = k_a, v_a
    if CHUNK_B > 0:
        k_b, v_b = _load_kv_chunk(tile, k0, k1, k2, k_desc_b, v_desc_b, k_rows, v_rows, stride_kn, stride_vn,
                                  TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA, LAYOUT, FP8)
    return k_a, v_a, k_b, v_b


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
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, WRITE_LSE: tl.constexpr,
    DEBUG: tl.constexpr, MASKED: tl.constexpr = True, USE_TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False, LAYOUT: tl.constexpr = 0,
    FP8: tl.constexpr = False, EXACT_CAST: tl.constexpr = False, SQ=None, SK=None, SV=None,
):
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    q_tile, bh, num_q_tiles, b, h = program_tile(heads, HEAD_MAJOR)

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
    kv_tiles_per_group = NK0 * NK1 * NK2
    kv_group = ((kg0 * D1 + gi1) * D2 + gi2) * kv_tiles_per_group  # group index, kg0 == gi0 but for frames
    q_row0 = q_tile * BLOCK_M
    if LAYOUT == 2:  # a 1-D layout read in place: rows past its end read zeros, stores there are dropped
        q_rows = L2
        kv_rows = L2
    else:  # permuted sequences: every group padded to whole tiles
        q_rows = num_q_tiles * BLOCK_M
        kv_rows = D0 * D1 * D2 * kv_tiles_per_group * BLOCK_N
    K_head = K + b * stride_kb + h * stride_kh
    if FP8:  # V transposed, [B, heads, head_dim, stride_v2] (kernels/common/fp8.py)
        tl.static_assert(LAYOUT != 1, "FP8 runs on permuted sequences or a 1-D layout")
        V_head = V + (b * heads + h) * HEAD_DIM * stride_v2
    else:
        V_head = V + b * stride_vb + h * stride_vh
    q_a, q_b = load_q_tile(Q + b * stride_qb + h * stride_qh, stride_q0, stride_q1, stride_q2, L0, L1, L2,
                           first0, first1, first2, q_row0, q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B,
                           USE_TMA, LAYOUT)
    k_desc_a, v_desc_a, k_desc_b, v_desc_b = kv_descriptors(
        K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, KL0, L1, L2, kv_rows,
        TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA, LAYOUT, FP8)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    k_rows = cols * stride_k2  # pointer loads (LAYOUT 0, no TMA): the first tile's keys, from K_head / V_head
    if FP8:
        v_rows = cols
        q_scale_rows = q_row0 + tl.arange(0, BLOCK_M)
        row_scale = qk_scale * tl.load(SQ + (b * q_rows + q_scale_rows) * heads + h, mask=q_scale_rows < q_rows,
                                       other=1.0)
        SK_head = SK + b * kv_rows * heads + h
    else:
        v_rows = cols * stride_v2
        row_scale = qk_scale
        SK_head = SK

    acc_a = tl.zeros([BLOCK_M, CHUNK_A], dtype=tl.float32)
    acc_b = acc_a  # one accumulator per column chunk; the first again, never updated, without a second chunk
    if CHUNK_B > 0:
        acc_b = tl.zeros([BLOCK_M, CHUNK_B], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    unmasked = num_kv * 0

    # Loop 1: the full KV tiles, a box [f0, g0) x [f1, g1) x [f2, g2) inside the visited box (per dimension the
    # full, unpadded tiles are one run); no mask code. Without MASKED the visited box is all full.
    if MASKED:
        f0, g0 = full_run(sl0, ef0, lo0, hi0, TK0)
        f1, g1 = full_run(sl1, ef1, lo1, hi1, TK1)
        f2, g2 = full_run(sl2, ef2, lo2, hi2, TK2)
        g0, num_full = inner_box(f0, g0, f1, g1, f2, g2, real_tile)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_kv
    k0 = f0
    k1 = f1
    k2 = f2
    for _ in tl.range(0, num_full, warp_specialize=WARP_SPECIALIZE):
        tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
        k_a, v_a, k_b, v_b = _load_kv(tile, k0, k1, k2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, k_rows, v_rows,
                                      stride_k2, stride_v2, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA,
                                      LAYOUT, FP8)
        qk = chunked_dot(q_a, q_b, k_a, k_b, CHUNK_B)
        if FP8:
            qk = qk * key_scales(SK_head, tile, kv_rows, heads, BLOCK_N)[None, :]
            acc_a, acc_b, l_i, m_i = softmax_step_fp8(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, row_scale, EXACT_CAST,
                                                      CHUNK_B)
        else:
            acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
        if DEBUG:
            unmasked += is_full(k0 * TK0, k1 * TK1, k2 * TK2, sl0, ef0, sl1, ef1, sl2, ef2, klen0, len1, len2,
                                TK0, TK1, TK2)
        k0, k1, k2 = next_tile(k0, k1, k2, f1, g1, f2, g2)

    # Loop 2: every other visited tile, each under the element mask (window and padding keys), in five slabs
    # around the full box.
    if MASKED:
        # Per-row windows (in-group coordinates, keys counted from the key range's first frame) and per-column
        # key offsets inside a KV tile.
        qs0, w0, qs1, w1, qs2, w2 = row_windows(qo0 + first0, first1, first2, glen0, len1, len2, W0, W1, W2,
                                                S0, S1, S2, C0, C1, C2, TQ0, TQ1, TQ2)
        qs0 -= ko0
        c0, c1, c2 = tile_coordinates(TK0, TK1, TK2)
        for j in tl.range(0, num_kv - num_full):
            k0, k1, k2 = slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2)
            tile = kv_group + (k0 * NK1 + k1) * NK2 + k2
            k_a, v_a, k_b, v_b = _load_kv(tile, k0, k1, k2, k_desc_a, v_desc_a, k_desc_b, v_desc_b, k_rows,
                                          v_rows, stride_k2, stride_v2, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B,
                                          USE_TMA, LAYOUT, FP8)
            qk = chunked_dot(q_a, q_b, k_a, k_b, CHUNK_B)
            keep = in_windows(qs0, w0, qs1, w1, qs2, w2, k0 * TK0 + c0, k1 * TK1 + c1, k2 * TK2 + c2, False)
            if FP8:
                qk = tl.where(keep, qk * key_scales(SK_head, tile, kv_rows, heads, BLOCK_N)[None, :], float("-inf"))
                acc_a, acc_b, l_i, m_i = softmax_step_fp8(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, row_scale,
                                                          EXACT_CAST, CHUNK_B)
            else:
                qk = tl.where(keep, qk, float("-inf"))
                acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
            if DEBUG:
                unmasked += is_full(k0 * TK0, k1 * TK1, k2 * TK2, sl0, ef0, sl1, ef1, sl2, ef2, klen0, len1, len2,
                                    TK0, TK1, TK2)

    if FP8:  # V's channel scales, and P's static 448 out of the sum (the LSE's units)
        SV_head = SV + (b * heads + h) * HEAD_DIM
        acc_a = acc_a * value_scales(SV_head, 0, CHUNK_A, HEAD_DIM)[None, :]
        if CHUNK_B > 0:
            acc_b = acc_b * value_scales(SV_head, CHUNK_A, CHUNK_B, HEAD_DIM)[None, :]
        l_i = l_i * (1.0 / 448.0)
    store_output(O + b * stride_ob + h * stride_oh, LSE, acc_a, acc_b, l_i, m_i, b, h, heads, stride_o0, stride_o1,
                 stride_o2, L0, L1, L2, first0, first1, first2, q_row0, q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A,
                 CHUNK_B, WRITE_LSE, USE_TMA, LAYOUT)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * q_tile, num_kv)
            tl.store(COUNTS + 2 * q_tile + 1, unmasked)
