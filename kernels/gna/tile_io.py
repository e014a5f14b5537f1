"""Where the GNA forward kernels' tiles live and how they move, as `@triton.jit` helpers shared by the static
(kernels/gna/forward.py) and the dynamic (kernels/gna/dynamic.py) kernel.

`LAYOUT` says where q, k, v and o are: 0, permuted sequences `[B, tokens, H, D]` (kernels/gna/permute.py), a
tile a run of tokens; 1, the caller's `[B, L0, L1, L2, H, D]` in place through rank-4 descriptors, a tile a
box of the layout whose padding lies out of bounds (read as zeros, stores dropped); 2, a 1-D layout in place
through the rank-2 descriptors of mode 0 over its real rows. `USE_TMA` moves mode 0's tiles through rank-2
descriptors too (the launcher sets it on every in-place call).

Tiles move in head_dim's column chunks (kernels/common/headdim.py: `CHUNK_A` columns, then `CHUNK_B` where that is
not 0), one descriptor or pointer load per chunk; columns past head_dim read zeros and are never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.headdim import load_columns, store_columns
from .geometry import layout_descriptor, tile_coordinates


@triton.jit
def program_tile(heads, HEAD_MAJOR: tl.constexpr):
    """This program's Q tile, its (batch * heads) index, the number of Q tiles, and its batch and head (int64).
    The grid is (Q tiles, batch * heads), or (batch * heads, Q tiles) with HEAD_MAJOR (tuning only)."""
    if HEAD_MAJOR:
        q_tile = tl.program_id(1)
        bh = tl.program_id(0)
        num_q_tiles = tl.num_programs(1)
    else:
        q_tile = tl.program_id(0)
        bh = tl.program_id(1)
        num_q_tiles = tl.num_programs(0)
    return q_tile, bh, num_q_tiles, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)


@triton.jit
def _load_q_chunk(Q_head, stride_q0, stride_q1, stride_q2, L0, L1, L2, first0, first1, first2, q_row0, q_rows,
                  TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  OFFSET: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr):
    """Columns `[OFFSET, OFFSET + WIDTH)` of the Q tile (`load_q_tile`), zeros past head_dim."""
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    if LAYOUT == 1:
        q_desc = layout_descriptor(Q_head, L0, L1, L2, stride_q0, stride_q1, stride_q2, TQ0, TQ1, TQ2, HEAD_DIM,
                                   WIDTH)
        q = q_desc.load([first0, first1, first2, OFFSET]).reshape([BLOCK_M, WIDTH])
    elif LAYOUT == 2 or USE_TMA:
        q_desc = tl.make_tensor_descriptor(Q_head, shape=[q_rows, HEAD_DIM], strides=[stride_q2, 1],
                                           block_shape=[BLOCK_M, WIDTH])
        q = q_desc.load([q_row0, OFFSET])
    else:
        rows = tl.arange(0, BLOCK_M)
        q = load_columns(Q_head, (q_row0 + rows).to(tl.int64) * stride_q2, OFFSET, WIDTH, HEAD_DIM)
    return q


@triton.jit
def load_q_tile(Q_head, stride_q0, stride_q1, stride_q2, L0, L1, L2, first0, first1, first2, q_row0, q_rows,
                TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr):
    """The `[BLOCK_M, head_dim]` Q tile of one head (`Q_head`) in its two column chunks (kernels/common/headdim.py;
    the second is the first again, never read, when CHUNK_B is 0): the box at (first0, first1, first2) of the
    layout (LAYOUT 1), or rows `[q_row0, q_row0 + BLOCK_M)` of a sequence of `q_rows` rows."""
    q_a = _load_q_chunk(Q_head, stride_q0, stride_q1, stride_q2, L0, L1, L2, first0, first1, first2, q_row0, q_rows,
                        TQ0, TQ1, TQ2, HEAD_DIM, 0, CHUNK_A, USE_TMA, LAYOUT)
    q_b = q_a
    if CHUNK_B > 0:
        q_b = _load_q_chunk(Q_head, stride_q0, stride_q1, stride_q2, L0, L1, L2, first0, first1, first2, q_row0,
                            q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA, LAYOUT)
    return q_a, q_b


@triton.jit
def _kv_chunk_descriptors(K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
                          KL0, L1, L2, kv_rows, TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
                          HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr,
                          FP8: tl.constexpr):
    """`kv_descriptors` of one column chunk of `WIDTH` columns."""
    BLOCK_N: tl.constexpr = TK0 * TK1 * TK2
    if LAYOUT == 1:
        k_desc = layout_descriptor(K_head, KL0, L1, L2, stride_k0, stride_k1, stride_k2, TK0, TK1, TK2, HEAD_DIM,
                                   WIDTH)
        v_desc = layout_descriptor(V_head, KL0, L1, L2, stride_v0, stride_v1, stride_v2, TK0, TK1, TK2, HEAD_DIM,
                                   WIDTH)
    elif LAYOUT == 2 or USE_TMA:
        k_desc = tl.make_tensor_descriptor(K_head, shape=[kv_rows, HEAD_DIM], strides=[stride_k2, 1],
                                           block_shape=[BLOCK_N, WIDTH])
        if FP8:
            v_desc = tl.make_tensor_descriptor(V_head, shape=[HEAD_DIM, stride_v2], strides=[stride_v2, 1],
                                               block_shape=[WIDTH, BLOCK_N])
        else:
            v_desc = tl.make_tensor_descriptor(V_head, shape=[kv_rows, HEAD_DIM], strides=[stride_v2, 1],
                                               block_shape=[BLOCK_N, WIDTH])
    else:
        k_desc = K_head
        v_desc = V_head
    return k_desc, v_desc


@triton.jit
def kv_descriptors(K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2,
                   KL0, L1, L2, kv_rows, TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr,
                   LAYOUT: tl.constexpr, FP8: tl.constexpr = False):
    """Tensor descriptors over one head's K and V, per column chunk (`k_a, v_a, k_b, v_b`; the second pair is the
    first again when CHUNK_B is 0): rank-4 boxes of a `[KL0, L1, L2]` layout (LAYOUT 1), or runs of `BLOCK_N` of
    `kv_rows` rows (LAYOUT 2, or 0 with USE_TMA); else the bare pointers (loads go through pointers then, and the
    descriptors are unused). Every descriptor's last dimension is the head's own head_dim columns, so a chunk's
    columns past head_dim read zeros. With FP8, V is `[head_dim, stride_v2]` (transposed, kernels/common/fp8.py)
    and its descriptors read `[chunk, BLOCK_N]` runs."""
    k_a, v_a = _kv_chunk_descriptors(K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1,
                                     stride_v2, KL0, L1, L2, kv_rows, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, USE_TMA,
                                     LAYOUT, FP8)
    k_b, v_b = k_a, v_a
    if CHUNK_B > 0:
        k_b, v_b = _kv_chunk_descriptors(K_head, V_head, stride_k0, stride_k1, stride_k2, stride_v0, stride_v1,
                                         stride_v2, KL0, L1, L2, kv_rows, TK0, TK1, TK2, HEAD_DIM, CHUNK_B, USE_TMA,
                                         LAYOUT, FP8)
    return k_a, v_a, k_b, v_b


@triton.jit
def _store_chunk(O_head, out, stride_o0, stride_o1, stride_o2, L0, L1, L2, first0, first1, first2, q_row0, q_rows,
                 TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 OFFSET: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr, LAYOUT: tl.constexpr):
    """Store columns `[OFFSET, OFFSET + WIDTH)` of the output rows (`store_output`), none past head_dim."""
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    if LAYOUT == 1:
        o_desc = layout_descriptor(O_head, L0, L1, L2, stride_o0, stride_o1, stride_o2, TQ0, TQ1, TQ2, HEAD_DIM,
                                   WIDTH)
        o_desc.store([first0, first1, first2, OFFSET], out.reshape([TQ0, TQ1, TQ2, WIDTH]))
    elif LAYOUT == 2 or USE_TMA:
        o_desc = tl.make_tensor_descriptor(O_head, shape=[q_rows, HEAD_DIM], strides=[stride_o2, 1],
                                           block_shape=[BLOCK_M, WIDTH])
        o_desc.store([q_row0, OFFSET], out)
    else:
        rows = tl.arange(0, BLOCK_M)
        store_columns(O_head, (q_row0 + rows).to(tl.int64) * stride_o2, out, OFFSET, WIDTH, HEAD_DIM)


@triton.jit
def store_output(O_head, LSE, acc_a, acc_b, l_i, m_i, b, h, heads, stride_o0, stride_o1, stride_o2, L0, L1, L2,
                 first0, first1, first2, q_row0, q_rows,
                 TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr,
                 LAYOUT: tl.constexpr):
    """Normalise the accumulators (one per column chunk, kernels/common/headdim.py) and store the Q tile's output
    rows (where `load_q_tile` read them) and, with WRITE_LSE, their natural-log LSE: `[B, L0, L1, L2, heads]`
    for LAYOUT 1 (padding rows dropped), else `[B, q_rows, heads]`. Padding queries (and only they) can end with
    no key at all: they get zeros, not 0 / 0."""
    BLOCK_M: tl.constexpr = TQ0 * TQ1 * TQ2
    rows = tl.arange(0, BLOCK_M)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc_a / l_safe[:, None]).to(O_head.dtype.element_ty)
    _store_chunk(O_head, out, stride_o0, stride_o1, stride_o2, L0, L1, L2, first0, first1, first2, q_row0, q_rows,
                 TQ0, TQ1, TQ2, HEAD_DIM, 0, CHUNK_A, USE_TMA, LAYOUT)
    if CHUNK_B > 0:
        out = (acc_b / l_safe[:, None]).to(O_head.dtype.element_ty)
        _store_chunk(O_head, out, stride_o0, stride_o1, stride_o2, L0, L1, L2, first0, first1, first2, q_row0,
                     q_rows, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA, LAYOUT)
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        if LAYOUT == 1:
            r0, r1, r2 = tile_coordinates(TQ0, TQ1, TQ2)
            x0 = first0 + r0
            x1 = first1 + r1
            x2 = first2 + r2
            tokens = ((x0 * L1 + x1) * L2 + x2).to(tl.int64)
            real = (x0 < L0) & (x1 < L1) & (x2 < L2)
            tl.store(LSE + (b * L0 * L1 * L2 + tokens) * heads + h, lse, mask=real)
        else:
            tokens = (q_row0 + rows).to(tl.int64)
            tl.store(LSE + (b * q_rows + tokens) * heads + h, lse, mask=tokens < q_rows)


@triton.jit
def key_scales(SK_head, tile, kv_rows, heads, BLOCK_N: tl.constexpr):
    """FP8 keys' scales (kernels/common/fp8.py) of KV tile `tile` of a sequence of `kv_rows` rows, from the
    `[rows, heads]` scales of one batch and head at `SK_head` (rows past the end read 0: their scores are
    masked anyway)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(SK_head + rows.to(tl.int64) * heads, mask=rows < kv_rows, other=0.0)
