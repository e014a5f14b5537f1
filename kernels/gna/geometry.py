"""Window and tile geometry as `@triton.jit` helpers: the one definition every GNA kernel uses.

- `window_bounds`: the GNA window along one dimension. It mirrors `natsim.window.window_bounds` line for line
  (gna-semantics.md, section 1); both are tested against the same brute-force mask.
- `tile_in_group`, `frame_groups`, `dim_setup`: where a tile lies (dilation group, in-group coordinates, frame
  ranges) and the KV tile range its queries' windows reach, per dimension.
- `full_run`, `is_full`: which visited KV tiles every real query attends completely (the unmasked loop).
- `layout_descriptor`: a rank-4 tensor descriptor over a token layout, in boxes of one tile.
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
def is_full(k0, k1, k2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2,
             TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """1 when every real query of the Q tile attends every real key of KV tile (k0, k1, k2), else 0 (DEBUG)."""
    full = (sl0 <= k0 * TK0) & (ef0 >= tl.minimum(k0 * TK0 + TK0, len0))
    full &= (sl1 <= k1 * TK1) & (ef1 >= tl.minimum(k1 * TK1 + TK1, len1))
    full &= (sl2 <= k2 * TK2) & (ef2 >= tl.minimum(k2 * TK2 + TK2, len2))
    return tl.where(full, 1, 0)


@triton.jit
def layout_descriptor(base, L0, L1, L2, stride0, stride1, stride2,
                       T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A rank-4 tensor descriptor over one head of a `[L0, L1, L2, head_dim]` token layout, in boxes of one tile:
    loads past the layout's end read zeros and stores there are dropped, so padding needs no memory."""
    return tl.make_tensor_descriptor(base, shape=[L0, L1, L2, HEAD_DIM], strides=[stride0, stride1, stride2, 1],
                                     block_shape=[T0, T1, T2, HEAD_DIM])
