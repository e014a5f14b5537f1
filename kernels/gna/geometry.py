"""Window and tile geometry as `@triton.jit` helpers: the one definition every GNA kernel uses.

- `window_bounds`: the GNA window along one dimension. It mirrors `natsim.window.window_bounds` line for line
  (gna-semantics.md, section 1); both are tested against the same brute-force mask.
- `tile_in_group`, `frame_groups`, `dim_setup`: where a tile lies (dilation group, in-group coordinates, frame
  ranges) and the KV tile range its queries' windows reach, per dimension.
- `full_run`, `inner_box`, `is_full`: which visited KV tiles every real query attends completely (the unmasked
  loop).
- `next_tile`, `slab_tile`: how the two loops walk a box of tiles: the inner box in row-major order, the rest
  of the outer box as six slabs around it.
- `tile_coordinates`, `row_windows`, `in_windows`, `window_mask`: the element mask of a (Q tile, KV tile) pair,
  one unsigned compare per dimension.
- `layout_descriptor`: a rank-4 tensor descriptor over a token layout, in boxes of one tile and column chunk.

Kernels always see three dimensions (kernels/gna/layout.py): a 1-D or 2-D problem has leading dimensions of
length 1.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def window_bounds(i, length, window, stride, CAUSAL: tl.constexpr):
    """Keys `[start, end)` attended by in-group coordinate(s) `i` on a group of `length` tokens."""
    if CAUSAL:
        leader = tl.minimum((i // stride) * stride + stride - 1, length - 1)
        start = tl.maximum(leader - window + 1, 0)
        end = tl.minimum(i + 1, length)
    else:
        leader = tl.minimum((i // stride) * stride + stride // 2, length - 1)
        start = tl.minimum(tl.maximum(leader - window // 2, 0), length - window)
        end = start + window
    return start, end


@triton.jit
def dim_setup(first, q_len, group_len, q_off, k_off, window, stride, CAUSAL: tl.constexpr, TQ: tl.constexpr,
               TK: tl.constexpr):
    """Per dimension: the Q tile's last real query, window bounds of first/last, and its KV tile range.

    `q_len` real queries of the local group sit at in-group coordinates `q_off + i` of a group of `group_len`;
    keys are local from in-group coordinate `k_off` (both offsets 0 and `q_len == group_len` but for dimension 0
    of a frame range, see `frame_groups`)."""
    last = tl.minimum(first + TQ, q_len) - 1
    start_first, end_first = window_bounds(first + q_off, group_len, window, stride, CAUSAL)
    start_last, end_last = window_bounds(last + q_off, group_len, window, stride, CAUSAL)
    start_first -= k_off
    end_first -= k_off
    start_last -= k_off
    end_last -= k_off
    kv_lo = start_first // TK
    kv_hi = (end_last + TK - 1) // TK
    return start_last, end_first, kv_lo, kv_hi


@triton.jit
def frame_groups(gi0, G0, KL0, Q0_OFF, K0_OFF, D0):
    """Dimension 0 of a frame range (halo exchange, natsim.distributed): q holds global frames
    `[Q0_OFF, Q0_OFF + L0)` of `G0`, k and v frames `[K0_OFF, K0_OFF + KL0)`. Local dilation group `gi0` of the
    queries is global group `(Q0_OFF + gi0) % D0`; returns the in-group offset of its first query, that group's
    global length, the local key group holding it, that key group's in-group offset and its local length. A
    whole layout (offsets 0, `G0 == KL0 == L0`) gives `0, len, gi0, 0, len`."""
    x0 = Q0_OFF + gi0
    gg0 = x0 % D0
    kg0 = (gg0 + D0 - K0_OFF % D0) % D0
    glen0 = G0 // D0 + tl.where(gg0 < G0 % D0, 1, 0)
    klen0 = KL0 // D0 + tl.where(kg0 < KL0 % D0, 1, 0)
    return x0 // D0, glen0, kg0, (K0_OFF + kg0) // D0, klen0


@triton.jit
def tile_in_group(tile, L0, L1, L2, D0, D1, D2, N0, N1, N2):
    """Where tile `tile` lies when tiles are numbered dilation group by group, N0 x N1 x N2 per group: the
    group's index and per-dimension coordinates, the group's per-dimension lengths, and the tile's
    per-dimension index inside the group (shared by the forward, dynamic and backward kernels)."""
    per_group = N0 * N1 * N2
    group = tile // per_group
    t = tile % per_group
    gi0 = group // (D1 * D2)
    gi1 = (group // D2) % D1
    gi2 = group % D2
    len0 = L0 // D0 + tl.where(gi0 < L0 % D0, 1, 0)
    len1 = L1 // D1 + tl.where(gi1 < L1 % D1, 1, 0)
    len2 = L2 // D2 + tl.where(gi2 < L2 % D2, 1, 0)
    return group, gi0, gi1, gi2, len0, len1, len2, t // (N1 * N2), (t // N2) % N1, t % N2


@triton.jit
def full_run(start_last, end_first, kv_lo, kv_hi, TK: tl.constexpr):
    """Per dimension: the run [f, g) of visited KV tiles that every real query attends completely, and that
    hold no padding keys (`end_first <= group length`); empty (f == g) when there is none."""
    f = tl.maximum((start_last + TK - 1) // TK, kv_lo)
    g = tl.minimum(end_first // TK, kv_hi)
    f = tl.minimum(f, kv_hi)
    return f, tl.maximum(f, g)


@triton.jit
def inner_box(f0, g0, f1, g1, f2, g2, real):
    """The inner box [f, g) as the unmasked loop walks it, and its tile count (0 when `real` is False: a tile of
    padding only). An inner box empty along some dimension is collapsed along dimension 0, so that the masked
    loop's slabs below and above it cover the whole outer box."""
    empty = (g0 == f0) | (g1 == f1) | (g2 == f2)
    g0 = tl.where(empty, f0, g0)
    return g0, tl.where(real, (g0 - f0) * (g1 - f1) * (g2 - f2), 0)


@triton.jit
def is_full(key0, key1, key2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2,
            TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """1 when every real query of the Q tile attends every real key of the KV tile whose first keys are (key0,
    key1, key2), else 0: the simulator's definition of a full tile (DEBUG counts)."""
    full = (sl0 <= key0) & (ef0 >= tl.minimum(key0 + TK0, len0))
    full &= (sl1 <= key1) & (ef1 >= tl.minimum(key1 + TK1, len1))
    full &= (sl2 <= key2) & (ef2 >= tl.minimum(key2 + TK2, len2))
    return tl.where(full, 1, 0)


@triton.jit
def next_tile(k0, k1, k2, f1, g1, f2, g2):
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
def slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2):
    """The j-th tile of the box [lo, hi) minus its inner box [f, g), in six slabs: below / above the inner run
    along dimension 0, then inside it below / above along dimension 1, then below / above along 2."""
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
def tile_coordinates(T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr):
    """Per row of a T0 x T1 x T2 tile (row-major): its offsets from the tile's corner along each dimension."""
    r = tl.arange(0, T0 * T1 * T2)
    return r // (T1 * T2), (r // T2) % T1, r % T2


@triton.jit
def row_windows(first0, first1, first2, len0, len1, len2, W0, W1, W2, S0, S1, S2,
                C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr):
    """Per query row of the Q tile whose corner is at in-group coordinates (first0, first1, first2): the start
    and the width (unsigned) of its window along each dimension."""
    r0, r1, r2 = tile_coordinates(TQ0, TQ1, TQ2)
    s0, e0 = window_bounds(first0 + r0, len0, W0, S0, C0)
    s1, e1 = window_bounds(first1 + r1, len1, W1, S1, C1)
    s2, e2 = window_bounds(first2 + r2, len2, W2, S2, C2)
    return s0, (e0 - s0).to(tl.uint32), s1, (e1 - s1).to(tl.uint32), s2, (e2 - s2).to(tl.uint32)


@triton.jit
def in_windows(s0, w0, s1, w1, s2, w2, y0, y1, y2, KEYS_FIRST: tl.constexpr):
    """`[rows, columns]` (`[columns, rows]` when KEYS_FIRST): row r keeps column c when key coordinate `y[c]`
    lies in `[s[r], s[r] + w[r])` along every dimension, one unsigned compare per dimension. Windows end
    inside their group, so padding keys fall outside every one."""
    if KEYS_FIRST:
        keep = (y0[:, None] - s0[None, :]).to(tl.uint32) < w0[None, :]
        keep &= (y1[:, None] - s1[None, :]).to(tl.uint32) < w1[None, :]
        keep &= (y2[:, None] - s2[None, :]).to(tl.uint32) < w2[None, :]
    else:
        keep = (y0[None, :] - s0[:, None]).to(tl.uint32) < w0[:, None]
        keep &= (y1[None, :] - s1[:, None]).to(tl.uint32) < w1[:, None]
        keep &= (y2[None, :] - s2[:, None]).to(tl.uint32) < w2[:, None]
    return keep


@triton.jit
def window_mask(q_first0, q_first1, q_first2, k_first0, k_first1, k_first2, len0, len1, len2,
                W0, W1, W2, S0, S1, S2, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
                TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """The element mask of the Q tile with corner `q_first` against the KV tile with corner `k_first` (in-group
    coordinates): `in_windows` of the tile's rows and columns."""
    s0, w0, s1, w1, s2, w2 = row_windows(q_first0, q_first1, q_first2, len0, len1, len2, W0, W1, W2, S0, S1, S2,
                                         C0, C1, C2, TQ0, TQ1, TQ2)
    c0, c1, c2 = tile_coordinates(TK0, TK1, TK2)
    return in_windows(s0, w0, s1, w1, s2, w2, k_first0 + c0, k_first1 + c1, k_first2 + c2, KEYS_FIRST)


@triton.jit
def layout_descriptor(base, L0, L1, L2, stride0, stride1, stride2,
                      T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, HEAD_DIM: tl.constexpr,
                      WIDTH: tl.constexpr):
    """A rank-4 tensor descriptor over one head of a `[L0, L1, L2, head_dim]` token layout, in boxes of one tile
    and one column chunk of `WIDTH` columns (kernels/common/headdim.py): loads past the layout's end or past
    head_dim read zeros and stores there are dropped, so padding needs no memory."""
    return tl.make_tensor_descriptor(base, shape=[L0, L1, L2, HEAD_DIM], strides=[stride0, stride1, stride2, 1],
                                     block_shape=[T0, T1, T2, WIDTH])
