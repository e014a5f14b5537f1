"""The GNA backward kernels (multi-D tiles, static KV tiling), flash-attention style, in place.

Three launches on the caller's `[B, *shape, heads, head_dim]` tensors (contiguous, seen as `[B, tokens, heads,
head_dim]`), with the forward's natural-log LSE:

1. `delta_kernel`: `delta = rowsum(dO * O) - dLSE` per query, in fp32, written head-major (the softmax
   backward's row term; a gradient flowing into the LSE output enters here, since d lse / d score = p).
2. `dkdv_kernel`: one program per KV tile. It finds, per dimension, the Q tiles whose static KV range (the
   forward's `start(first) // T_KV .. ceil(end(last) / T_KV) - 1`, kernels/gna/forward.py) holds this KV tile, by
   binary search over the Q tiles with `window_bounds` (start and end never decrease, so they form one run
   per dimension), and among those the run of full pairs. It recomputes `p = exp(q k^T * scale - lse)` for
   each visiting Q tile and accumulates `dV += p^T dO` and `dK += (p * (dO V^T - delta))^T Q * scale`.
3. `dq_kernel`: one program per Q tile over the same KV tiles as the forward (its `dim_setup` /
   `full_run`), accumulating `dQ += (p * (dO V^T - delta)) K * scale`. It runs on the mirrored tiles: the
   dK/dV kernel's KV box as its Q tile and its Q tile as the KV tile (128 queries against 64 keys, the
   forward's proportions), so that each K and V tile it loads serves 128 queries.

Tiles are boxes of the layout, cut per dilation group (kernels/gna/layout.py); a program gathers a tile's rows from
their places in the caller's layout (`_tile_rows`: one head's row is `head_dim` contiguous elements wherever
it lies, so a gathered row costs what a row of a permuted copy would) and scatters dq, dk, dv back the same
way: no permuted copies of q, k, v, out or dO (at HunyuanVideo size the backward's peak extra memory is
2.0 GB instead of 8.2). A row past its group's end (padding, only when some tile holds such rows: `PADDED`)
reads the group's last token instead and is never stored; a padding query gets an infinite LSE, so that its p
is 0 against every key.

Every `[rows, head_dim]` tile and gradient moves and accumulates in head_dim's power-of-two column chunks
(kernels/common/headdim.py, as the forward: scores and dP summed over chunks, one dK, dV or dQ accumulator per
chunk); past 128 computed columns the KV tiles hold 64 keys (`kv_tile_tokens`).

Both attention kernels run two loops as the forward does: the full box (every real query attends every key;
no padding keys) without any mask code, then the rest of the visited box (five slabs around it) under the
element mask. `MASKED=False` (the host's `needs_mask`: dense and block-sparse configurations) compiles the
first loop alone over the whole box. The LSE and delta are read head-major (`[B, H, tokens]`, contiguous per
head). With DEBUG on, the dK/dV kernel counts per KV tile the Q tiles it ran and how many of them are full
(gna-semantics.md's definition), to be held against `natsim.simulate_backward`.

Tuning (`DEFAULT_VARIANT`, `benchmarks/backward.py --tune`, benchmarks/results/backward-*.json): three stages for
both kernels, dQ on the mirrored tiles, `IN_TILE` (a row's token is its tile's first token plus a fixed in-tile
offset: 5% more PTX instructions in the dK/dV loop than the permuted kernels had; computing each row's token
from its coordinates, 16% more and 3-6% slower on the H100, backward-inplace-ab-*.json).
`USE_TMA` (on where `uses_descriptors` allows): an unmasked kernel reads its stepped tiles (the dK/dV kernel's Q
and dO, the dQ kernel's K and V) as boxes of rank-4 tensor descriptors over the tile's dilation group, in
place, instead of gathering rows; bit for bit the same results.
`ATOMIC_DQ` (off) has the dK/dV kernel add each pair's `ds k` to an fp32 dQ with atomics instead (five tile
products per pair, no dQ kernel, dQ's summation order varying from run to run): Nsight Compute showed its
atomics missing L2 at HunyuanVideo sizes (40 GB of DRAM traffic against 9 GB for the dK/dV kernel without
them), and on the H100 `gna_backward` took 112.6 / 107.2 ms with it against 106.2 / 102.9 ms without, at
strides 1x8x8 / 16x8x8 (then on permuted copies). `ATOMIC_DQ=2` adds each pair's dQ with one bulk tensor reduce
of the tile's box into a head-major fp32 dQ instead: in place (2026-11-25) 99.6 / 120.8 / 199.4 ms against
98.3 / 105.6 / 209.7 at 16x8x8 / 1x8x8 / 1x1x1, so it stays off.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from natsim import Problem

from ..common.backend import interpreting
from ..common.backward import dkdv_step, dq_step, launch_options, softmax_delta
from ..common.devices import on_their_device
from ..common.headdim import HeadSplit, head_split, load_columns, store_columns
from ..common.launch import descriptors_fit, install_allocator, split_of
from ..common.softmax import LOG2E
from .geometry import (dim_setup, full_run, inner_box, is_full, next_tile, slab_tile, tile_in_group, window_bounds,
                       window_mask)
from .launch import dense_as_1d, needs_mask
from .layout import TileLayout, as_3d
from .tiles import box_shapes, halves, relative_cost


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
    of the forward's `dim_setup`), the run [f, g) of them whose pair is full without padding keys (what
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
def _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2,
               C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
               TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
               TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr):
    """1 when every real query of Q tile (t0, t1, t2) attends every real key of KV tile (j0, j1, j2) (DEBUG)."""
    sl0, ef0, _, _ = dim_setup(t0 * TQ0, len0, len0, 0, 0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, _, _ = dim_setup(t1 * TQ1, len1, len1, 0, 0, W1, S1, C1, TQ1, TK1)
    sl2, ef2, _, _ = dim_setup(t2 * TQ2, len2, len2, 0, 0, W2, S2, C2, TQ2, TK2)
    return is_full(j0 * TK0, j1 * TK1, j2 * TK2, sl0, ef0, sl1, ef1, sl2, ef2, len0, len1, len2, TK0, TK1, TK2)


@triton.jit
def _in_tile_tokens(L1, L2, D0, D1, D2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr):
    """How far each row of a tile lies from the tile's first row, in tokens of the caller's layout (row-major
    over `[L0, L1, L2]`; int32, as a tile spans less than the layout): the same for every tile of a program,
    since tiles differ only in where they start."""
    r = tl.arange(0, T0 * T1 * T2)
    return ((r // (T1 * T2)) * D0 * L1 + ((r // T2) % T1) * D1) * L2 + (r % T2) * D2


@triton.jit
def _tile_rows(i0, i1, i2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2, in_tile, row_stride,
               T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, PADDED: tl.constexpr, IN_TILE: tl.constexpr):
    """Where tile (i0, i1, i2) of dilation group (gi0, gi1, gi2) lives in the caller's layout: its rows' tokens
    (int64, for the LSE and delta), the element offsets of its rows' first elements from the head's first
    element, and which rows are real.

    Without padding, a row's token is, with IN_TILE, the tile's first token plus the program's fixed in-tile
    offset (`in_tile`: one add per row), else computed from the row's coordinates. With PADDED, a row past its
    group's end lives nowhere in memory: its coordinates are clamped to the group's last token, so that loads
    need no mask, and callers neutralise it (`_load_stats`) and never store it. (Replacing padding rows'
    tokens with `tl.where` instead spilled more registers in the masked dK/dV kernel: 496-744 bytes against
    312 on sm_90, benchmarks/compile_backward.py.)"""
    r = tl.arange(0, T0 * T1 * T2)
    if IN_TILE and not PADDED:
        token = ((gi0 + D0 * i0 * T0).to(tl.int64) * L1 + gi1 + D1 * i1 * T1) * L2 + gi2 + D2 * i2 * T2 + in_tile
        real = r >= 0  # every row
    else:
        c0 = i0 * T0 + r // (T1 * T2)
        c1 = i1 * T1 + (r // T2) % T1
        c2 = i2 * T2 + r % T2
        real = (c0 < len0) & (c1 < len1) & (c2 < len2)
        if PADDED:
            c0 = tl.minimum(c0, len0 - 1)
            c1 = tl.minimum(c1, len1 - 1)
            c2 = tl.minimum(c2, len2 - 1)
        token = ((gi0 + D0 * c0).to(tl.int64) * L1 + gi1 + D1 * c1) * L2 + gi2 + D2 * c2
    return token, token * row_stride, real


@triton.jit
def _group_descriptor(HEAD, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2, row_stride,
                      T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, HEAD_DIM: tl.constexpr,
                      WIDTH: tl.constexpr):
    """A rank-4 tensor descriptor over one dilation group of one head (`HEAD`: the head's first element) of the
    caller's `[B, L0, L1, L2, heads, head_dim]` layout, seen as `[len0, len1, len2, head_dim]`, in boxes of one
    tile and one column chunk of `WIDTH` columns: a tile's rows arrive in one bulk copy per chunk, and rows past
    the group's end (padding) and columns past head_dim read as zeros. `row_stride` (int64): elements from one
    token to the next."""
    first = ((gi0 * L1 + gi1) * L2 + gi2) * row_stride
    return tl.make_tensor_descriptor(
        HEAD + first, shape=[len0, len1, len2, HEAD_DIM],
        strides=[D0 * L1 * L2 * row_stride, D1 * L2 * row_stride, D2 * row_stride, 1],
        block_shape=[T0, T1, T2, WIDTH])


@triton.jit
def _chunk_descriptors(HEAD, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2, row_stride,
                       T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, HEAD_DIM: tl.constexpr,
                       CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr):
    """`_group_descriptor`s of one tensor's head (the tiles a kernel steps over), one per column chunk (the
    second is the first again when CHUNK_B is 0), with USE_TMA; else the bare head pointer twice (`_load_tile`
    gathers then)."""
    if USE_TMA:
        a = _group_descriptor(HEAD, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2, row_stride,
                              T0, T1, T2, HEAD_DIM, CHUNK_A)
        b = a
        if CHUNK_B > 0:
            b = _group_descriptor(HEAD, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2, row_stride,
                                  T0, T1, T2, HEAD_DIM, CHUNK_B)
    else:
        a = HEAD
        b = HEAD
    return a, b


@triton.jit
def _load_chunk(P, desc, offsets, t0, t1, t2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                HEAD_DIM: tl.constexpr, OFFSET: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr):
    """Columns `[OFFSET, OFFSET + WIDTH)` of `_load_tile`'s rows, zeros past head_dim."""
    if USE_TMA:
        x = desc.load([t0 * T0, t1 * T1, t2 * T2, OFFSET]).reshape([T0 * T1 * T2, WIDTH])
    else:
        x = load_columns(P, offsets, OFFSET, WIDTH, HEAD_DIM)
    return x


@triton.jit
def _load_tile(P, desc_a, desc_b, offsets, t0, t1, t2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
               HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile (t0, t1, t2)'s `[rows, head_dim]` rows in column chunks (`x_a, x_b`; the second is the first again
    when CHUNK_B is 0): one bulk copy per chunk through the descriptors, or a gather at the rows' `offsets`
    (padding rows clamped by `_tile_rows`; through the descriptor they read zeros instead: either way their
    contribution is cancelled by an infinite LSE or the element mask)."""
    x_a = _load_chunk(P, desc_a, offsets, t0, t1, t2, T0, T1, T2, HEAD_DIM, 0, CHUNK_A, USE_TMA)
    x_b = x_a
    if CHUNK_B > 0:
        x_b = _load_chunk(P, desc_b, offsets, t0, t1, t2, T0, T1, T2, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    return x_a, x_b


@triton.jit
def _load_stats(LSE, DELTA, stat, real, PADDED: tl.constexpr):
    """`lse * log2(e)` and delta of the rows at `stat` in the head-major statistics. A padding query gets an
    infinite LSE, so that its p is 0 against every key: it adds nothing to dK and dV, whatever row it read."""
    lse2 = tl.load(LSE + stat) * 1.4426950408889634
    if PADDED:
        lse2 = tl.where(real, lse2, float("inf"))
    return lse2, tl.load(DELTA + stat)


@triton.jit
def _store_rows(P, offsets, values_a, values_b, real, HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr,
                CHUNK_B: tl.constexpr, PADDED: tl.constexpr):
    """Rows at `offsets` of `P` = the column chunks `values_a` (and `values_b`) on the real rows, none past
    head_dim."""
    if PADDED:
        row_ok = real
    else:
        row_ok = None
    store_columns(P, offsets, values_a, 0, CHUNK_A, HEAD_DIM, row_ok)
    if CHUNK_B > 0:
        store_columns(P, offsets, values_b, CHUNK_A, CHUNK_B, HEAD_DIM, row_ok)


@triton.jit
def _add_dq_chunk(DQ, dq_desc, q_offsets, q_real, ds, k, scale, t0, t1, t2,
                  TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  OFFSET: tl.constexpr, WIDTH: tl.constexpr, PADDED: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """`_add_dq` for columns `[OFFSET, OFFSET + WIDTH)` (`k`: that chunk of the KV tile), none past head_dim."""
    part = tl.dot(tl.trans(ds), k) * scale
    if ATOMIC_DQ == 2:
        dq_desc.atomic_add([t0 * TQ0, t1 * TQ1, t2 * TQ2, OFFSET], part.reshape([TQ0, TQ1, TQ2, WIDTH]))
    else:
        cols = OFFSET + tl.arange(0, WIDTH)
        mask = (cols < HEAD_DIM)[None, :]
        if PADDED:
            mask = mask & q_real[:, None]
        tl.atomic_add(DQ + q_offsets[:, None] + cols[None, :], part, mask=mask, sem="relaxed")


@triton.jit
def _add_dq(DQ, dq_desc_a, dq_desc_b, q_offsets, q_real, ds, k_a, k_b, scale, t0, t1, t2,
            TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr, HEAD_DIM: tl.constexpr,
            CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, PADDED: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Add this pair's `ds k * scale` to the fp32 dQ rows of Q tile (t0, t1, t2), per column chunk: ATOMIC_DQ 1
    with relaxed element atomics into the token-major dQ (`DQ`: this head's first element), 2 with one bulk
    tensor reduce per chunk of the tile's box into the head-major dQ (`dq_desc_a` / `dq_desc_b`: this dilation
    group of this head; padding rows lie out of its bounds and are dropped). Either way the summation order
    varies from run to run."""
    _add_dq_chunk(DQ, dq_desc_a, q_offsets, q_real, ds, k_a, scale, t0, t1, t2, TQ0, TQ1, TQ2, HEAD_DIM, 0,
                  CHUNK_A, PADDED, ATOMIC_DQ)
    if CHUNK_B > 0:
        _add_dq_chunk(DQ, dq_desc_b, q_offsets, q_real, ds, k_b, scale, t0, t1, t2, TQ0, TQ1, TQ2, HEAD_DIM,
                      CHUNK_A, CHUNK_B, PADDED, ATOMIC_DQ)


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, COUNTS,
    tokens, heads, qk_scale, scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2, STEPS0, STEPS1, STEPS2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, MASKED: tl.constexpr,
    PADDED: tl.constexpr, DEBUG: tl.constexpr, ATOMIC_DQ: tl.constexpr = 0, IN_TILE: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,
):
    kv_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    _, gi0, gi1, gi2, len0, len1, len2, j0, j1, j2 = tile_in_group(kv_tile, L0, L1, L2, D0, D1, D2,
                                                                     NK0, NK1, NK2)

    # Which Q tiles visit this KV tile, per dimension: [lo, hi), and the full run [f, g) inside it.
    lo0, hi0, f0, g0 = _q_runs(j0, len0, W0, S0, STEPS0, C0, TQ0, TK0)
    lo1, hi1, f1, g1 = _q_runs(j1, len1, W1, S1, STEPS1, C1, TQ1, TK1)
    lo2, hi2, f2, g2 = _q_runs(j2, len2, W2, S2, STEPS2, C2, TQ2, TK2)
    num_q = (hi0 - lo0) * (hi1 - lo1) * (hi2 - lo2)
    if MASKED:
        g0, num_full = inner_box(f0, g0, f1, g1, f2, g2, True)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_q

    row_stride = heads * HEAD_DIM
    base = b * tokens * row_stride + h * HEAD_DIM  # this head's first element
    stats = bh.to(tl.int64) * tokens  # this head's LSE and delta, head-major
    q_in_tile = _in_tile_tokens(L1, L2, D0, D1, D2, TQ0, TQ1, TQ2)
    kv_in_tile = _in_tile_tokens(L1, L2, D0, D1, D2, TK0, TK1, TK2)
    kv_token, kv_offsets, kv_real = _tile_rows(j0, j1, j2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                               kv_in_tile, row_stride, TK0, TK1, TK2, PADDED, IN_TILE)
    # Every [rows, head_dim] tile and gradient in head_dim's column chunks (kernels/common/headdim.py): `_a`,
    # and `_b` where CHUNK_B is not 0 (else the `_a` one again, never read).
    k_a, k_b = _load_tile(K + base, K, K, kv_offsets, 0, 0, 0, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, False)
    v_a, v_b = _load_tile(V + base, V, V, kv_offsets, 0, 0, 0, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B, False)
    q_desc_a, q_desc_b = _chunk_descriptors(Q + base, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                            base * 0 + row_stride, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B,
                                            USE_TMA)
    do_desc_a, do_desc_b = _chunk_descriptors(DO + base, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                              base * 0 + row_stride, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B,
                                              USE_TMA)
    if ATOMIC_DQ == 2:  # this head's dilation group of the head-major `[B, heads, L0, L1, L2, head_dim]` dQ
        dq_desc_a, dq_desc_b = _chunk_descriptors(DQ + (stats + (gi0 * L1 + gi1) * L2 + gi2) * HEAD_DIM, 0, 0, 0,
                                                  len0, len1, len2, L1, L2, D0, D1, D2, base * 0 + HEAD_DIM,
                                                  TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, True)
    else:
        dq_desc_a = DQ  # unused
        dq_desc_b = DQ
    dk_a = tl.zeros([TK0 * TK1 * TK2, CHUNK_A], dtype=tl.float32)
    dv_a = tl.zeros([TK0 * TK1 * TK2, CHUNK_A], dtype=tl.float32)
    dk_b = dk_a
    dv_b = dv_a
    if CHUNK_B > 0:
        dk_b = tl.zeros([TK0 * TK1 * TK2, CHUNK_B], dtype=tl.float32)
        dv_b = tl.zeros([TK0 * TK1 * TK2, CHUNK_B], dtype=tl.float32)
    visited = num_q * 0
    full = num_q * 0

    # Loop 1: the full pairs, no mask code (without MASKED, every visiting Q tile).
    t0 = f0
    t1 = f1
    t2 = f2
    for _ in tl.range(0, num_full):
        q_token, q_offsets, q_real = _tile_rows(t0, t1, t2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                                q_in_tile, row_stride, TQ0, TQ1, TQ2, PADDED, IN_TILE)
        q_a, q_b = _load_tile(Q + base, q_desc_a, q_desc_b, q_offsets, t0, t1, t2, TQ0, TQ1, TQ2, HEAD_DIM,
                              CHUNK_A, CHUNK_B, USE_TMA)
        do_a, do_b = _load_tile(DO + base, do_desc_a, do_desc_b, q_offsets, t0, t1, t2, TQ0, TQ1, TQ2, HEAD_DIM,
                                CHUNK_A, CHUNK_B, USE_TMA)
        lse2, delta = _load_stats(LSE, DELTA, stats + q_token, q_real, PADDED)
        dk_a, dk_b, dv_a, dv_b, ds = dkdv_step(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, q_a, q_b, do_a, do_b,
                                               lse2, delta, qk_scale, 0, False, CHUNK_B)
        if ATOMIC_DQ:
            _add_dq(DQ + base, dq_desc_a, dq_desc_b, q_offsets, q_real, ds, k_a, k_b, scale, t0, t1, t2,
                    TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, PADDED, ATOMIC_DQ)
        if DEBUG:
            visited += 1
            full += _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                               TQ0, TQ1, TQ2, TK0, TK1, TK2)
        t0, t1, t2 = next_tile(t0, t1, t2, f1, g1, f2, g2)

    # Loop 2: every other visiting Q tile, under the element mask.
    if MASKED:
        for j in tl.range(0, num_q - num_full):
            t0, t1, t2 = slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2)
            q_token, q_offsets, q_real = _tile_rows(t0, t1, t2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1,
                                                    D2, q_in_tile, row_stride, TQ0, TQ1, TQ2, PADDED, IN_TILE)
            q_a, q_b = _load_tile(Q + base, q_desc_a, q_desc_b, q_offsets, t0, t1, t2, TQ0, TQ1, TQ2, HEAD_DIM,
                                  CHUNK_A, CHUNK_B, USE_TMA)
            do_a, do_b = _load_tile(DO + base, do_desc_a, do_desc_b, q_offsets, t0, t1, t2, TQ0, TQ1, TQ2,
                                    HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
            lse2, delta = _load_stats(LSE, DELTA, stats + q_token, q_real, PADDED)
            keep = window_mask(t0 * TQ0, t1 * TQ1, t2 * TQ2, j0 * TK0, j1 * TK1, j2 * TK2,
                                len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                                TQ0, TQ1, TQ2, TK0, TK1, TK2, True)
            dk_a, dk_b, dv_a, dv_b, ds = dkdv_step(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, q_a, q_b, do_a,
                                                   do_b, lse2, delta, qk_scale, keep, True, CHUNK_B)
            if ATOMIC_DQ:
                _add_dq(DQ + base, dq_desc_a, dq_desc_b, q_offsets, q_real, ds, k_a, k_b, scale, t0, t1, t2,
                        TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, PADDED, ATOMIC_DQ)
            if DEBUG:
                visited += 1
                full += _full_pair(t0, t1, t2, j0, j1, j2, len0, len1, len2, W0, W1, W2, S0, S1, S2, C0, C1, C2,
                                   TQ0, TQ1, TQ2, TK0, TK1, TK2)

    _store_rows(DK + base, kv_offsets, dk_a * scale, dk_b * scale, kv_real, HEAD_DIM, CHUNK_A, CHUNK_B, PADDED)
    _store_rows(DV + base, kv_offsets, dv_a, dv_b, kv_real, HEAD_DIM, CHUNK_A, CHUNK_B, PADDED)
    if DEBUG:
        if bh == 0:
            tl.store(COUNTS + 2 * kv_tile, visited)
            tl.store(COUNTS + 2 * kv_tile + 1, full)


@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    tokens, heads, qk_scale, scale,
    L0, L1, L2, W0, W1, W2, S0, S1, S2, D0, D1, D2,
    NQ0, NQ1, NQ2, NK0, NK1, NK2,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    TQ0: tl.constexpr, TQ1: tl.constexpr, TQ2: tl.constexpr,
    TK0: tl.constexpr, TK1: tl.constexpr, TK2: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, MASKED: tl.constexpr,
    PADDED: tl.constexpr, IN_TILE: tl.constexpr = False, USE_TMA: tl.constexpr = False,
):
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    _, gi0, gi1, gi2, len0, len1, len2, i0, i1, i2 = tile_in_group(q_tile, L0, L1, L2, D0, D1, D2,
                                                                     NQ0, NQ1, NQ2)
    first0 = i0 * TQ0
    first1 = i1 * TQ1
    first2 = i2 * TQ2
    real_tile = (first0 < len0) & (first1 < len1) & (first2 < len2)

    # The forward's KV tiles of this Q tile, and the full box inside them.
    sl0, ef0, lo0, hi0 = dim_setup(first0, len0, len0, 0, 0, W0, S0, C0, TQ0, TK0)
    sl1, ef1, lo1, hi1 = dim_setup(first1, len1, len1, 0, 0, W1, S1, C1, TQ1, TK1)
    sl2, ef2, lo2, hi2 = dim_setup(first2, len2, len2, 0, 0, W2, S2, C2, TQ2, TK2)
    num_kv = tl.where(real_tile, (hi0 - lo0) * (hi1 - lo1) * (hi2 - lo2), 0)
    if MASKED:
        f0, g0 = full_run(sl0, ef0, lo0, hi0, TK0)
        f1, g1 = full_run(sl1, ef1, lo1, hi1, TK1)
        f2, g2 = full_run(sl2, ef2, lo2, hi2, TK2)
        g0, num_full = inner_box(f0, g0, f1, g1, f2, g2, real_tile)
    else:
        f0, g0, f1, g1, f2, g2 = lo0, hi0, lo1, hi1, lo2, hi2
        num_full = num_kv

    row_stride = heads * HEAD_DIM
    base = b * tokens * row_stride + h * HEAD_DIM  # this head's first element
    q_in_tile = _in_tile_tokens(L1, L2, D0, D1, D2, TQ0, TQ1, TQ2)
    q_token, q_offsets, q_real = _tile_rows(i0, i1, i2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                            q_in_tile, row_stride, TQ0, TQ1, TQ2, PADDED, IN_TILE)
    # Every [rows, head_dim] tile and dQ in head_dim's column chunks, as in the dK/dV kernel.
    q_a, q_b = _load_tile(Q + base, Q, Q, q_offsets, 0, 0, 0, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B, False)
    do_a, do_b = _load_tile(DO + base, DO, DO, q_offsets, 0, 0, 0, TQ0, TQ1, TQ2, HEAD_DIM, CHUNK_A, CHUNK_B,
                            False)
    lse2, delta = _load_stats(LSE, DELTA, bh.to(tl.int64) * tokens + q_token, q_real, PADDED)
    dq_a = tl.zeros([TQ0 * TQ1 * TQ2, CHUNK_A], dtype=tl.float32)
    dq_b = dq_a
    if CHUNK_B > 0:
        dq_b = tl.zeros([TQ0 * TQ1 * TQ2, CHUNK_B], dtype=tl.float32)
    kv_in_tile = _in_tile_tokens(L1, L2, D0, D1, D2, TK0, TK1, TK2)
    k_desc_a, k_desc_b = _chunk_descriptors(K + base, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                            base * 0 + row_stride, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B,
                                            USE_TMA)
    v_desc_a, v_desc_b = _chunk_descriptors(V + base, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1, D2,
                                            base * 0 + row_stride, TK0, TK1, TK2, HEAD_DIM, CHUNK_A, CHUNK_B,
                                            USE_TMA)

    k0 = f0
    k1 = f1
    k2 = f2
    for _ in tl.range(0, num_full):
        kv_token, kv_offsets, kv_real = _tile_rows(k0, k1, k2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0, D1,
                                                   D2, kv_in_tile, row_stride, TK0, TK1, TK2, PADDED, IN_TILE)
        k_a, k_b = _load_tile(K + base, k_desc_a, k_desc_b, kv_offsets, k0, k1, k2, TK0, TK1, TK2, HEAD_DIM,
                              CHUNK_A, CHUNK_B, USE_TMA)
        v_a, v_b = _load_tile(V + base, v_desc_a, v_desc_b, kv_offsets, k0, k1, k2, TK0, TK1, TK2, HEAD_DIM,
                              CHUNK_A, CHUNK_B, USE_TMA)
        dq_a, dq_b = dq_step(dq_a, dq_b, q_a, q_b, do_a, do_b, k_a, k_b, v_a, v_b, lse2, delta, qk_scale, 0, False,
                             CHUNK_B)
        k0, k1, k2 = next_tile(k0, k1, k2, f1, g1, f2, g2)

    if MASKED:
        for j in tl.range(0, num_kv - num_full):
            k0, k1, k2 = slab_tile(j, lo0, hi0, lo1, hi1, lo2, hi2, f0, g0, f1, g1, f2, g2)
            kv_token, kv_offsets, kv_real = _tile_rows(k0, k1, k2, gi0, gi1, gi2, len0, len1, len2, L1, L2, D0,
                                                       D1, D2, kv_in_tile, row_stride, TK0, TK1, TK2, PADDED,
                                                       IN_TILE)
            k_a, k_b = _load_tile(K + base, k_desc_a, k_desc_b, kv_offsets, k0, k1, k2, TK0, TK1, TK2, HEAD_DIM,
                                  CHUNK_A, CHUNK_B, USE_TMA)
            v_a, v_b = _load_tile(V + base, v_desc_a, v_desc_b, kv_offsets, k0, k1, k2, TK0, TK1, TK2, HEAD_DIM,
                                  CHUNK_A, CHUNK_B, USE_TMA)
            keep = window_mask(first0, first1, first2, k0 * TK0, k1 * TK1, k2 * TK2, len0, len1, len2,
                                W0, W1, W2, S0, S1, S2, C0, C1, C2, TQ0, TQ1, TQ2, TK0, TK1, TK2, False)
            dq_a, dq_b = dq_step(dq_a, dq_b, q_a, q_b, do_a, do_b, k_a, k_b, v_a, v_b, lse2, delta, qk_scale, keep,
                                 True, CHUNK_B)

    _store_rows(DQ + base, q_offsets, dq_a * scale, dq_b * scale, q_real, HEAD_DIM, CHUNK_A, CHUNK_B, PADDED)


# -- host side: tiles, launches ------------------------------------------------------------------------------------

KV_TILE_TOKENS = 128  # keys per backward KV tile; its Q tile holds 1 / 2**Q_TILE_HALVINGS as many queries
# Keys per backward KV tile over 128 columns (kernels/common/headdim.py, `WIDE`): the dK/dV program's two
# `[keys, width]` fp32 accumulators of 128 x 256 would take 256 registers a thread at 8 warps.
WIDE_KV_TILE_TOKENS = 64
# 1: 64 queries per 128 keys. 2 (32 queries) keeps the dK/dV kernel's registers under 255 without spills at
# head_dim 128 on sm_90 (benchmarks/compile_backward.py); benchmarks/backward.py --tune times both.
Q_TILE_HALVINGS = 1
# The variant `gna_backward` runs unless told otherwise: launch options and the tuning switches ATOMIC_DQ and
# IN_TILE over `launch_options`' defaults (`DQ_STAGES` sets the dQ kernel's stages alone); benchmarks/backward.py
# --tune times the alternatives.
DEFAULT_VARIANT: dict = {"ATOMIC_DQ": False, "IN_TILE": True, "USE_TMA": True}  # H100 winners (module docstring)
# Tile products per visited (Q tile, KV tile) pair: the dK/dV kernel's q k^T, dO v^T, p^T dO and ds^T q (plus
# ds^T k with ATOMIC_DQ), and the dQ kernel's q k^T, dO v^T and ds k on its own (mirrored) pairs.
DKDV_PRODUCTS = 4
DQ_PRODUCTS = 3
# Tiles for layouts too small for any 128-token box: the forward's fallback shapes, queries halved.
FALLBACK_TILES = {1: ((64,), (128,)), 2: ((8, 8), (16, 8)), 3: ((1, 8, 8), (2, 8, 8))}


def kv_tile_tokens(head_dim: int) -> int:
    """Keys per backward KV tile at `head_dim`: 128, or 64 where its column chunks compute more than 128 columns
    (`WIDE_KV_TILE_TOKENS`)."""
    return WIDE_KV_TILE_TOKENS if head_split(head_dim).wide else KV_TILE_TOKENS


def backward_tiles(problem: Problem, head_dim: int,
                   q_halvings: Optional[int] = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The backward's (Q tile, KV tile): KV boxes of 128 keys (64 over 128 columns, `kv_tile_tokens`) and Q tiles
    of half of one (the mirror of the forward's 128-query / 64-key pairs: the dK/dV program keeps two `[keys,
    head_dim]` fp32 accumulators), or of a quarter with `q_halvings=2` (default: Q_TILE_HALVINGS), the one with
    the least predicted work by the forward's relative costs (kernels/gna/tiles.py)."""
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
    pairs = [(q_shape, kv_shape) for kv_shape in box_shapes(kv_tile_tokens(head_dim), limits)
             for q_shape in _q_shapes(kv_shape, q_halvings)]
    if not pairs:
        return FALLBACK_TILES[problem.ndim]  # 128-key tiles even over 128 columns: layouts this small are cheap
    return min(pairs, key=lambda pair: relative_cost(problem, pair[0], pair[1], head_dim))


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


def padded(problem: Problem, *tiles: tuple[int, ...]) -> bool:
    """Whether a tile of any of `tiles` holds padding rows: the tiles of a dimension are cut per dilation group
    to cover the longest group (TileLayout), so some group's last tile may reach past its end. Padding rows
    then need masked loads and stores."""
    from natsim.window import group_length

    return any(-(-L // (tile[i] * d)) * tile[i] != group_length(L, d, g)
               for tile in tiles
               for i, (L, d) in enumerate(zip(problem.shape, problem.dilation))
               for g in range(d))


def _backward(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, q_tile, kv_tile, scale: float, debug: bool,
              options: Optional[dict]):
    """dq, dk, dv (and the dK/dV kernel's `[KV tiles, 2]` debug counts, else None) of contiguous `[B, tokens,
    H, D]` tensors in the caller's token order (row-major over `problem.shape`), with the LSE and `grad_lse`
    (or None) `[B, tokens, H]` in fp32. `options` override `DEFAULT_VARIANT` (module docstring)."""
    batch, tokens, heads, head_dim = q.shape
    options = {**DEFAULT_VARIANT, **(options or {})}
    split = split_of(head_dim, tuple(options.items()))
    options.pop("CHUNK_A", None)
    options.pop("CHUNK_B", None)
    atomic = int(options.pop("ATOMIC_DQ", 0))
    dq_stages = options.pop("DQ_STAGES", None)
    fit = descriptors_fit(q, k, v, grad_out)
    tma = bool(options.pop("USE_TMA", False)) and fit
    if atomic == 2 and (not fit or interpreting()):
        atomic = 1  # bulk reduces need descriptors, and Triton's interpreter has none
    if tma or atomic == 2:
        install_allocator()
    delta = softmax_delta(out, grad_out, grad_lse)
    lse = lse.transpose(1, 2).contiguous()  # head-major, as delta
    pad = padded(problem, q_tile, kv_tile)
    dk, dv, dq, counts = _dkdv(q, k, v, grad_out, lse, delta, problem, q_tile, kv_tile, scale, split, pad, debug,
                               atomic, tma, dict(options))
    if atomic == 2:
        return torch.empty_like(q).copy_(dq.transpose(1, 2)), dk, dv, counts
    if atomic:
        return dq.to(q.dtype), dk, dv, counts
    if dq_stages is not None:
        options["num_stages"] = dq_stages
    # The dQ kernel on the mirrored tiles: the KV box as its Q tile, the Q tile as its KV tile.
    return (_dq(q, grad_out, k, v, lse, delta, problem, kv_tile, q_tile, scale, split, pad, tma, options), dk, dv,
            counts)


@on_their_device
def _dkdv(q, k, v, grad_out, lse, delta, problem: Problem, q_tile, kv_tile, scale: float, split: HeadSplit,
          pad: bool, debug: bool, atomic: int, tma: bool, options: dict):
    """The dK/dV kernel's launch: dk, dv, dq (fp32, summed by atomics; None without `atomic`), counts. With
    `tma`, an unmasked kernel steps over its Q tiles through tensor descriptors (`uses_descriptors`)."""
    q_layout = TileLayout(problem.shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(problem.shape, kv_tile, problem.dilation).to_3d()
    batch, tokens, heads, head_dim = q.shape
    masked = needs_mask(problem, q_tile, kv_tile)
    options = {**launch_options(q_layout.tile_tokens, kv_layout.tile_tokens, split).triton_options(), **options,
               "USE_TMA": uses_descriptors(tma, masked)}
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    shape = (batch, heads, tokens, head_dim) if atomic == 2 else q.shape  # head-major for bulk reduces
    dq = torch.zeros(shape, dtype=torch.float32, device=q.device) if atomic else None
    counts = torch.zeros((kv_layout.num_tiles, 2), dtype=torch.int32, device=q.device) if debug else None
    steps = {f"STEPS{i}": n.bit_length() + 1 for i, n in enumerate(q_layout.tiles_per_group)}
    dkdv_kernel[(kv_layout.num_tiles, batch * heads)](
        q, k, v, grad_out, lse, delta, dk, dv, dk if dq is None else dq, delta if counts is None else counts,
        tokens=tokens, heads=heads, qk_scale=scale * LOG2E, scale=scale, **split.constexprs(),
        MASKED=masked, PADDED=pad, **_problem_arguments(problem, q_layout, kv_layout), **steps, DEBUG=debug,
        ATOMIC_DQ=atomic, **options)
    return dk, dv, dq, counts


@on_their_device
def _dq(q, grad_out, k, v, lse, delta, problem: Problem, q_tile, kv_tile, scale: float, split: HeadSplit,
        pad: bool, tma: bool, options: dict):
    """The dQ kernel's launch on its own tiles; with `tma`, an unmasked kernel steps over its KV tiles through
    tensor descriptors (`uses_descriptors`)."""
    q_layout = TileLayout(problem.shape, q_tile, problem.dilation).to_3d()
    kv_layout = TileLayout(problem.shape, kv_tile, problem.dilation).to_3d()
    batch, tokens, heads, head_dim = q.shape
    masked = needs_mask(problem, q_tile, kv_tile)
    options = {**launch_options(q_layout.tile_tokens, kv_layout.tile_tokens, split).triton_options(), **options,
               "USE_TMA": uses_descriptors(tma, masked)}
    dq = torch.empty_like(q)
    dq_kernel[(q_layout.num_tiles, batch * heads)](
        q, k, v, grad_out, lse, delta, dq, tokens=tokens, heads=heads, qk_scale=scale * LOG2E, scale=scale,
        **split.constexprs(), MASKED=masked, PADDED=pad, **_problem_arguments(problem, q_layout, kv_layout), **options)
    return dq


def uses_descriptors(tma: bool, masked: bool) -> bool:
    """Whether a kernel's stepped tiles move through tensor descriptors: only where its loops carry no mask
    code (dense and block-sparse configurations). Measured on the H100 (bf16, head_dim 128, 24 heads): 6% faster
    at HunyuanVideo 16x8x8 (90.8 against 96.6 ms) and dense (986 against 1045), 2% at 1x8x8 and 1x1x1, but 3-17%
    slower on masked 2-D, dilated and padded layouts (benchmarks/results/backward-tma-*.json)."""
    return tma and not masked


def gna_backward(q, k, v, out, lse, grad_out, grad_lse, problem: Problem, scale: Optional[float] = None,
                 q_tile: Optional[tuple[int, ...]] = None, kv_tile: Optional[tuple[int, ...]] = None,
                 options: Optional[dict] = None):
    """dq, dk, dv of GNA on `[B, *shape, H, D]` tensors, from the forward's output and natural-log LSE
    `[B, *shape, H]`; `grad_lse` may be None. Tiles default to `backward_tiles` (dense attention as 1-D over the
    flattened layout, as the forward runs it). The kernels read and write the caller's layout in place;
    `options` override the launch options and tuning switches of `DEFAULT_VARIANT` (benchmarks/backward.py
    --tune) and may name head_dim's column chunks `CHUNK_A` / `CHUNK_B` (kernels/common/headdim.py)."""
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if q_tile is None and kv_tile is None:
        problem = dense_as_1d(problem) or problem
        q_tile, kv_tile = backward_tiles(problem, head_dim)
    tokens = problem.num_tokens

    def flat(x, dtype=None):  # [B, tokens, ...] contiguous (no copy when it already is); detached
        return x.detach().to(dtype or x.dtype).reshape(batch, tokens, *x.shape[q.dim() - 2:]).contiguous()

    lse = flat(lse, torch.float32)
    grad_lse = None if grad_lse is None else flat(grad_lse, torch.float32)
    dq, dk, dv, _ = _backward(flat(q), flat(k), flat(v), flat(out), lse, flat(grad_out, q.dtype), grad_lse,
                              problem, q_tile, kv_tile, scale, False, options)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def backward_tile_counts(problem: Problem, q_tile: tuple[int, ...], kv_tile: tuple[int, ...], head_dim: int = 32,
                         device: str = "cuda", dtype: torch.dtype = torch.float16):
    """Run the backward with the dK/dV kernel's debug counters on (random inputs, batch 1, one head) and return
    `(visited, full)` per KV tile in the tiles' order (dilation group by group, row-major inside one): the Q
    tiles it ran and how many of those pairs are full. Compare with `natsim.simulate_backward`."""
    tokens = problem.num_tokens
    q, k, v, out, grad_out = (torch.randn((1, tokens, 1, head_dim), device=device, dtype=dtype) for _ in range(5))
    lse = torch.zeros((1, tokens, 1), device=device)
    *_, counts = _backward(q, k, v, out, lse, grad_out, None, problem, q_tile, kv_tile, head_dim**-0.5, True, None)
    counts = counts.cpu().numpy().astype("int64")
    return counts[:, 0], counts[:, 1]
