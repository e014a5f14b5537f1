"""Sparse attention for any block mask (FG-Attn, sections 4-5 and appendix B): the Triton forward kernel and its
launch (`run_sparse`) on a prepared `SparseWork` (kernels/sparse/work.py).

Semantics: query i attends key j exactly when `mask[b, h, i // q_block, j // kv_block]`; a query that attends
no key gets output 0 and LSE -inf. N need not be a multiple of either block.

How one program works (one *work item*: a group of query blocks of one (batch, head)):
- Query merging. A program holds BLOCK_M queries: `R = BLOCK_M // q_block` query blocks (the members), chosen
  by `merge`: consecutive blocks, or natsim's XOR greedy (`natsim.merge`, FG-Attn section 5.2). The members'
  rows are gathered from q with pointer loads and the outputs scattered back, so any grouping runs.
- Fine-grained KV (FG-Attn's gather-load). The program walks one list: the UNION of its members' KV blocks,
  packed `P = BLOCK_N // kv_block` blocks per tile of BLOCK_N keys. Each tile's key rows are gathered with
  pointer loads from the listed block indices; `tl.range` pipelines them (the index loads a stage ahead) with
  the matrix products. With `kv_block == BLOCK_N` on Hopper a tile is one block, read through a rank-2 tensor
  descriptor instead.
- Two loops, as in kernels/gna/forward.py. The list starts with the blocks that every member attends and that lie
  wholly before N ("full for the group"): their whole tiles run with no mask code, because every row of a
  real member attends every key there, and the rows of no member (padding) are never stored. The rest of
  the list (partial blocks, and the few full ones that do not fill a whole tile) runs under the element
  mask: each list entry carries a bit per member (does member m attend this block?), and row r keeps
  column c when bit `r // q_block` of c's entry is set and key c < N. The output of a row therefore
  depends on its own block's row of the mask only, never on the grouping.
- Scheduling. `"grid"`: one program per work item. `"lpt"`: a persistent kernel of about one program per SM
  slot; programs take work items from a queue (one atomic counter) sorted longest-first by list length
  (longest-processing-time first, FG-Attn appendix B).
- PV skip (`pv_threshold`, SpargeAttn's second stage, its section 3.4): per tile, a member whose real rows all
  have their tile maximum more than `-pv_threshold` below their running maximum leaves the tile's P @ V out
  of its accumulator (the running sum still counts the tile); a tile every member skips runs no P @ V.
  `kernels/sparse/reference.py` is the torch reference of the rule, walking the same tiles.
- DEBUG (a constexpr, compiled out otherwise): each work item records the KV blocks it loaded and the (query
  block, KV block) pairs it computed (loaded blocks times its members), the figures `natsim.merge` predicts
  (`MergeResult.merged.visited` and `visited * group_sizes`), and the attended (query block, KV block) pairs
  of the mask whose P @ V the PV skip left out.

The online softmax is GNA's (`softmax_step`, base 2, fp32 accumulators, the running maximum in scaled units).
q, k, v and the accumulators move in head_dim's column chunks (kernels/common/headdim.py: `head_split`'s, padded
in FP8), columns past head_dim read as zeros and never stored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..common.launch import descriptors_fit, install_allocator, launch_config, with_fp8
from ..common.backend import interpreting
from ..common.devices import on_their_device
from ..common.fp8 import (Fp8Scales, check_fp8_device, check_fp8_tiles, fp8_head_split,
                          prequantized_rows, quantize, value_scales)
from ..common.headdim import chunk_columns, chunked_dot, head_split, load_columns, store_columns
from ..common.softmax import LOG2E, softmax_step, softmax_step_fp8
from .checks import check_sparse_kernel, check_sparse_qkv, check_work
from .spec import SparseSpec
from .work import SparseWork


# -- the kernel ---------------------------------------------------------------------------------------------------


@triton.jit
def _load_chunk(K, V, k_desc, v_desc, blk, key, ok, stride_kn, stride_vn, HEAD_DIM: tl.constexpr,
                OFFSET: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                USE_TMA: tl.constexpr, FP8: tl.constexpr):
    """Columns `[OFFSET, OFFSET + WIDTH)` of `_load_kv_tile`'s K and V (keys `key`; `ok` the real ones, read
    only when MASKED), zeros past head_dim."""
    if USE_TMA:
        k = k_desc.load([blk * BLOCK_N, OFFSET])
        if FP8:
            v = v_desc.load([OFFSET, blk * BLOCK_N]).T
        else:
            v = v_desc.load([blk * BLOCK_N, OFFSET])
    else:
        if MASKED:
            row_ok = ok
        else:
            row_ok = None
        k = load_columns(K, key * stride_kn, OFFSET, WIDTH, HEAD_DIM, row_ok)
        if FP8:  # V transposed: a key's channels lie `stride_vn` apart
            channels = chunk_columns(OFFSET, WIDTH)
            mask = None
            if OFFSET + WIDTH > HEAD_DIM:
                mask = (channels < HEAD_DIM)[None, :]
            if MASKED:
                if mask is None:
                    mask = ok[:, None]
                else:
                    mask = mask & ok[:, None]
            v_ptrs = V + key[:, None] + channels[None, :].to(tl.int64) * stride_vn
            if mask is None:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=mask, other=0.0)
        else:
            v = load_columns(V, key * stride_vn, OFFSET, WIDTH, HEAD_DIM, row_ok)
    return k, v


@triton.jit
def _load_kv_tile(K, V, k_desc_a, v_desc_a, k_desc_b, v_desc_b, LIST, e0, end, slots, within, seq_len, stride_kn,
                  stride_vn, KVB: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                  FP8: tl.constexpr):
    """K and V `[BLOCK_N, chunk]` of the tile whose list entries start at `e0` (column c holds key `within[c]` of
    the block at entry `e0 + slots[c]`) in head_dim's column chunks (`k_a, v_a, k_b, v_b`; the second pair is the
    first again when CHUNK_B is 0), each column's entry and key, and whether the column is a real key (entry
    before `end`, key before N). Unmasked tiles are whole and before N; masked ones read zeros elsewhere. With
    FP8, V is stored transposed (`[head_dim, rows]`, row length `stride_vn`)."""
    e = e0 + slots
    ok = e < end
    if USE_TMA:  # one block per tile: a rank-2 descriptor read, rows past N read as zeros
        blk = tl.load(LIST + e0, mask=e0 < end, other=0)
        key = blk * BLOCK_N + within
        ok &= key < seq_len
    elif MASKED:
        blk = 0
        key = tl.load(LIST + e, mask=ok, other=0) * KVB + within
        ok &= key < seq_len
        key = key.to(tl.int64)
    else:
        blk = 0
        key = (tl.load(LIST + e) * KVB + within).to(tl.int64)
    k_a, v_a = _load_chunk(K, V, k_desc_a, v_desc_a, blk, key, ok, stride_kn, stride_vn, HEAD_DIM, 0, CHUNK_A,
                           BLOCK_N, MASKED, USE_TMA, FP8)
    k_b, v_b = k_a, v_a
    if CHUNK_B > 0:
        k_b, v_b = _load_chunk(K, V, k_desc_b, v_desc_b, blk, key, ok, stride_kn, stride_vn, HEAD_DIM, CHUNK_A,
                               CHUNK_B, BLOCK_N, MASKED, USE_TMA, FP8)
    return k_a, v_a, k_b, v_b, e, ok, key


@triton.jit
def _kv_descriptors(K_bh, V_bh, seq_len, stride_kn, stride_vn, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    WIDTH: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr):
    """With USE_TMA, rank-2 descriptors over one head's K and V reading `[BLOCK_N, WIDTH]` column chunks (their
    last dimension the head's own head_dim columns: past it, zeros); with FP8, V's reads `[WIDTH, BLOCK_N]` of V
    transposed. Else the bare pointers (loads go through pointers)."""
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K_bh, shape=[seq_len, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, WIDTH])
        if FP8:
            v_desc = tl.make_tensor_descriptor(V_bh, shape=[HEAD_DIM, stride_vn], strides=[stride_vn, 1],
                                               block_shape=[WIDTH, BLOCK_N])
        else:
            v_desc = tl.make_tensor_descriptor(V_bh, shape=[seq_len, HEAD_DIM], strides=[stride_vn, 1],
                                               block_shape=[BLOCK_N, WIDTH])
    else:
        k_desc = K_bh
        v_desc = V_bh
    return k_desc, v_desc


@triton.jit
def _skipping_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, pv_lambda, row_ok,
                   QB: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr):
    """`softmax_step` with SpargeAttn's PV skip (its section 3.4, Algorithm 1 line 15): the scores `qk` still
    update the running maximum and sum of every row, but a query block (a member: `QB` consecutive rows) whose
    real rows all have their tile maximum below their running maximum by more than `pv_lambda` (scaled base-2
    units, negative) adds nothing to its accumulator; when every member skips, P @ V is not computed at all.
    Returns the new state (accumulators per column chunk, as `softmax_step`) and which rows skipped."""
    R: tl.constexpr = BLOCK_M // QB
    m_local = tl.max(qk, 1) * qk_scale
    m_new = tl.maximum(m_i, m_local)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_a = acc_a * alpha[:, None]
    if CHUNK_B > 0:
        acc_b = acc_b * alpha[:, None]
    gap = tl.where(row_ok, m_local - m_new, float("-inf"))
    skip = tl.max(tl.reshape(gap, [R, QB]), 1) < pv_lambda  # per member
    skip_row = tl.reshape(tl.broadcast_to(skip[:, None], [R, QB]), [BLOCK_M])
    if tl.sum(tl.where(skip_row, 0, 1)) > 0:
        kept = tl.where(skip_row[:, None], 0.0, p)
        acc_a = tl.dot(kept.to(v_a.dtype), v_a, acc_a)
        if CHUNK_B > 0:
            acc_b = tl.dot(kept.to(v_b.dtype), v_b, acc_b)
    return acc_a, acc_b, l_i, m_new, skip_row


@triton.jit
def _attend_item(
    w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
    heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, WRITE_LSE: tl.constexpr,
    DEBUG: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PV_SKIP: tl.constexpr,
    FP8: tl.constexpr, EXACT_CAST: tl.constexpr, SQ, SK, SV,
):
    """Attention of work item `w` = (batch * heads + head) * groups + group: its members' query rows against
    the union of their KV blocks (module docstring)."""
    R: tl.constexpr = BLOCK_M // QB
    P: tl.constexpr = BLOCK_N // KVB
    bh = w // groups
    g = w % groups
    b = bh // heads
    h = bh % heads
    item = ((b * mask_b_step) * mask_heads + h * mask_h_step) * groups + g  # its lists (masks broadcast)
    b = b.to(tl.int64)
    h = h.to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    member = rows // QB
    q_blk = tl.load(MEMBERS + item * R + member)  # -1 where the group is short
    token = q_blk * QB + rows % QB
    row_ok = (q_blk >= 0) & (token < seq_len)
    token = token.to(tl.int64)
    # q, k, v and the accumulators in head_dim's column chunks (kernels/common/headdim.py): `_a`, and `_b` where
    # CHUNK_B is not 0 (else the `_a` one again, never read).
    Q_bh = Q + b * stride_qb + h * stride_qh
    q_a = load_columns(Q_bh, token * stride_qn, 0, CHUNK_A, HEAD_DIM, row_ok)
    q_b = q_a
    if CHUNK_B > 0:
        q_b = load_columns(Q_bh, token * stride_qn, CHUNK_A, CHUNK_B, HEAD_DIM, row_ok)

    cols = tl.arange(0, BLOCK_N)
    slots = cols // KVB
    within = cols % KVB
    K_bh = K + b * stride_kb + h * stride_kh
    if FP8:  # V transposed, [B, heads, head_dim, stride_vn] (kernels/common/fp8.py); scales per row and channel
        V_bh = V + (b * heads + h) * HEAD_DIM * stride_vn
        row_scale = qk_scale * tl.load(SQ + (b * seq_len + token) * heads + h, mask=row_ok, other=1.0)
        SK_bh = SK + b * seq_len * heads + h
    else:
        V_bh = V + b * stride_vb + h * stride_vh
        row_scale = qk_scale
        SK_bh = SK
    k_desc_a, v_desc_a = _kv_descriptors(K_bh, V_bh, seq_len, stride_kn, stride_vn, BLOCK_N, HEAD_DIM, CHUNK_A,
                                         USE_TMA, FP8)
    k_desc_b, v_desc_b = k_desc_a, v_desc_a
    if CHUNK_B > 0:
        k_desc_b, v_desc_b = _kv_descriptors(K_bh, V_bh, seq_len, stride_kn, stride_vn, BLOCK_N, HEAD_DIM, CHUNK_B,
                                             USE_TMA, FP8)
    start = tl.load(OFFSETS + item)
    end = tl.load(OFFSETS + item + 1)
    full_tiles = tl.load(FULL_TILES + item)

    acc_a = tl.zeros([BLOCK_M, CHUNK_A], dtype=tl.float32)
    acc_b = acc_a
    if CHUNK_B > 0:
        acc_b = tl.zeros([BLOCK_M, CHUNK_B], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    loaded = full_tiles * 0  # DEBUG: KV blocks loaded
    skipped = full_tiles * 0  # DEBUG: attended (query block, KV block) pairs whose P @ V the PV skip left out
    leader = (q_blk >= 0) & (rows % QB == 0)  # one row per real member

    # Loop 1: whole tiles of blocks every member attends, wholly before N: no mask code.
    for t in tl.range(0, full_tiles, warp_specialize=WARP_SPECIALIZE):
        k_a, v_a, k_b, v_b, e, ok, key = _load_kv_tile(K_bh, V_bh, k_desc_a, v_desc_a, k_desc_b, v_desc_b, LIST,
                                                       start + t * P, end, slots, within, seq_len, stride_kn,
                                                       stride_vn, KVB, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, False,
                                                       USE_TMA, FP8)
        qk = chunked_dot(q_a, q_b, k_a.T, k_b.T, CHUNK_B)
        if FP8:
            qk = qk * tl.load(SK_bh + key * heads)[None, :]
            acc_a, acc_b, l_i, m_i = softmax_step_fp8(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, row_scale, EXACT_CAST,
                                                      CHUNK_B)
        elif PV_SKIP:
            acc_a, acc_b, l_i, m_i, skip_row = _skipping_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale,
                                                              pv_lambda, row_ok, QB, BLOCK_M, CHUNK_B)
            if DEBUG:
                skipped += tl.sum(tl.where(leader & skip_row, 1, 0)) * P
        else:
            acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
        if DEBUG:
            loaded += P

    # Loop 2: the rest of the list, under the element mask (own block's bit, key < N, entry < end).
    e_masked = start + full_tiles * P
    for t in tl.range(0, tl.cdiv(end - e_masked, P)):
        e0 = e_masked + t * P
        k_a, v_a, k_b, v_b, e, ok, key = _load_kv_tile(K_bh, V_bh, k_desc_a, v_desc_a, k_desc_b, v_desc_b, LIST,
                                                       e0, end, slots, within, seq_len, stride_kn, stride_vn, KVB,
                                                       BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, True, USE_TMA, FP8)
        bits = tl.load(BITS + e, mask=e < end, other=0)
        keep = (((bits[None, :] >> member[:, None]) & 1) != 0) & ok[None, :]
        qk = chunked_dot(q_a, q_b, k_a.T, k_b.T, CHUNK_B)
        if FP8:
            qk = tl.where(keep, qk * tl.load(SK_bh + key * heads, mask=ok, other=0.0)[None, :], float("-inf"))
            acc_a, acc_b, l_i, m_i = softmax_step_fp8(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, row_scale, EXACT_CAST,
                                                      CHUNK_B)
        elif PV_SKIP:
            qk = tl.where(keep, qk, float("-inf"))
            acc_a, acc_b, l_i, m_i, skip_row = _skipping_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale,
                                                              pv_lambda, row_ok, QB, BLOCK_M, CHUNK_B)
            if DEBUG:  # the entries of the tile each skipping member attends
                attended = (((bits[None, :] >> member[:, None]) & 1) != 0) & (e < end)[None, :] \
                    & (within == 0)[None, :]
                skipped += tl.sum(tl.where(leader & skip_row, tl.sum(attended.to(tl.int32), 1), 0))
        else:
            qk = tl.where(keep, qk, float("-inf"))
            acc_a, acc_b, l_i, m_i = softmax_step(acc_a, acc_b, l_i, m_i, qk, v_a, v_b, qk_scale, CHUNK_B)
        if DEBUG:
            loaded += tl.minimum(end - e0, P)

    if FP8:  # V's channel scales, and P's static 448 out of the sum (the LSE's units)
        SV_bh = SV + (b * heads + h) * HEAD_DIM
        acc_a = acc_a * value_scales(SV_bh, 0, CHUNK_A, HEAD_DIM)[None, :]
        if CHUNK_B > 0:
            acc_b = acc_b * value_scales(SV_bh, CHUNK_A, CHUNK_B, HEAD_DIM)[None, :]
        l_i = l_i * (1.0 / 448.0)
    # A row that attends no key (its block's row is empty) gets zeros and LSE -inf, not 0 / 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    O_bh = O + b * stride_ob + h * stride_oh
    store_columns(O_bh, token * stride_on, acc_a / l_safe[:, None], 0, CHUNK_A, HEAD_DIM, row_ok)
    if CHUNK_B > 0:
        store_columns(O_bh, token * stride_on, acc_b / l_safe[:, None], CHUNK_A, CHUNK_B, HEAD_DIM, row_ok)
    if WRITE_LSE:  # [B, N, heads]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(LSE + (b * seq_len + token) * heads + h, lse, mask=row_ok)
    if DEBUG:  # per work item: KV blocks loaded, (query block, KV block) pairs computed and PV-skipped
        real_members = tl.sum(tl.where(leader, 1, 0))
        tl.store(COUNTS + 3 * w, loaded)
        tl.store(COUNTS + 3 * w + 1, loaded * real_members)
        tl.store(COUNTS + 3 * w + 2, skipped)


@triton.jit
def sparse_forward_kernel(
    Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS, ORDER, QUEUE,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
    heads, groups, num_items, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, WRITE_LSE: tl.constexpr,
    DEBUG: tl.constexpr, USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
    PV_SKIP: tl.constexpr = False,
    FP8: tl.constexpr = False, EXACT_CAST: tl.constexpr = False, SQ=None, SK=None, SV=None,
):
    """Grid: one program per work item, grid (groups, batch * heads). Persistent: programs take work items
    from `ORDER` (longest first) through the atomic counter `QUEUE` until none is left."""
    if PERSISTENT:
        i = tl.atomic_add(QUEUE, 1)
        while i < num_items:
            w = tl.load(ORDER + i)
            _attend_item(w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
                         stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                         stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                         heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
                         QB, KVB, BLOCK_M, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, WRITE_LSE, DEBUG, USE_TMA,
                         WARP_SPECIALIZE, PV_SKIP, FP8, EXACT_CAST, SQ, SK, SV)
            i = tl.atomic_add(QUEUE, 1)
    else:
        w = tl.program_id(1) * groups + tl.program_id(0)
        _attend_item(w, Q, K, V, O, LSE, COUNTS, MEMBERS, OFFSETS, FULL_TILES, LIST, BITS,
                     stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                     stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                     heads, groups, mask_heads, mask_b_step, mask_h_step, seq_len, qk_scale, pv_lambda,
                     QB, KVB, BLOCK_M, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, WRITE_LSE, DEBUG, USE_TMA,
                     WARP_SPECIALIZE, PV_SKIP, FP8, EXACT_CAST, SQ, SK, SV)


# -- launch --------------------------------------------------------------------------------------------------------


def default_programs(device: torch.device, num_warps: int) -> int:
    """Persistent programs: one per SM for 8-warp 128-query programs, two for smaller ones (4 in the
    interpreter)."""
    if device.type != "cuda":
        return 4
    per_sm = 1 if num_warps >= 8 else 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


@on_their_device
def run_sparse(
    work: SparseWork,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: SparseSpec,
    scales: Optional[Fp8Scales] = None,
    *,
    debug: bool = False,
    specialize: bool = False,
):
    """`(out, lse, counts)` of one launch of `spec` on prepared work (`lse` None unless `spec.return_lse`;
    `counts` int32 `[B * H * groups, 3]` with `debug`: KV blocks loaded, pairs computed, pairs PV-skipped; else
    None); `spec.pv_threshold` (None or negative) turns on the PV skip. `specialize` warp-specializes the unmasked
    loop where its tiles load through descriptors (8 warps, 2 stages; Triton 3.6 builds it with 8 warps, not
    with 4), except with the LSE or debug counts (the LSE came out wrong under Triton 3.6's warp specialization in
    the GNA kernel); benchmarks/sparse.py --tune times it. Precision "fp8" quantizes q, k, v first
    (kernels/common/fp8.py) and runs the kernel's FP8 variant (no PV skip, no warp specialization); q, k, v
    given in float8 come with their full-size `scales` (`check_fp8_call`) and `spec.out_dtype`, and are read as
    they are."""
    check_sparse_qkv(q, k, v)
    check_sparse_kernel(q, float8=scales is not None)
    check_work(work, q)
    batch, seq_len, heads, head_dim = q.shape
    fp8 = spec.precision == "fp8"
    return_lse, pv_threshold = spec.return_lse, spec.pv_threshold
    out_dtype = q.dtype if scales is None else spec.out_dtype
    kernel_scales = (None, None, None)
    if fp8:
        check_fp8_device(q)
        check_fp8_tiles(q, work.block_m, work.block_n)
        quantized = (quantize(q, k, v, q_dot_mean=return_lse) if scales is None
                     else prequantized_rows(q, k, v, scales.q_scale, scales.k_scale, scales.v_scale))
        q, k, v = quantized.q, quantized.k, quantized.v_t
        kernel_scales = (quantized.q_scale, quantized.k_scale, quantized.v_scale)
        specialize = False
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, seq_len, heads), dtype=torch.float32, device=q.device) if return_lse else None
    items = batch * heads * work.groups
    counts = torch.zeros((items, 3), dtype=torch.int32, device=q.device) if debug else None
    use_tma = work.block_n == work.kv_block and descriptors_fit(k, v)
    if use_tma:
        install_allocator()
    split = fp8_head_split(head_dim) if fp8 else head_split(head_dim)
    launch = launch_config(work.block_m, work.block_n, split, masked=True, tma=use_tma, specialize=False)
    if fp8:
        launch = with_fp8(launch, work.block_m, work.block_n, split)
    specialize = specialize and use_tma and not (return_lse or debug or pv_threshold is not None)
    if specialize:
        launch = replace(launch, num_warps=8, num_stages=2)
    persistent = spec.schedule == "lpt"
    if persistent:
        order = work.order(batch, heads)
        queue = torch.zeros(1, dtype=torch.int32, device=q.device)
        programs = spec.programs
        count = default_programs(q.device, launch.num_warps) if programs is None else programs  # spec-checked
        grid = (min(count, items),)
    else:
        order = queue = work.offsets  # unused
        grid = (work.groups, batch * heads)
    scale = head_dim**-0.5 if spec.scale is None else spec.scale
    key = (work.block_m, work.block_n, work.q_block, work.kv_block, split, q.dtype, use_tma, persistent,
           return_lse, debug, specialize, pv_threshold is not None, fp8)
    stages = _STAGES.get(key, launch.num_stages)
    while True:
        try:
            sparse_forward_kernel[grid](
                q, k, v, out, out if lse is None else lse, out if counts is None else counts,
                work.members, work.offsets, work.full_tiles, work.kv_list, work.member_bits, order, queue,
                *_bnh(q), *_bnh(k), *((0, v.shape[-1], 0) if fp8 else _bnh(v)), *_bnh(out),
                heads, work.groups, items, work.mask_heads, 0 if work.mask_batch == 1 else 1,
                0 if work.mask_heads == 1 else 1, seq_len, scale * LOG2E,
                0.0 if pv_threshold is None else pv_threshold * LOG2E,
                QB=work.q_block, KVB=work.kv_block, BLOCK_M=work.block_m, BLOCK_N=work.block_n, **split.constexprs(),
                WRITE_LSE=return_lse, DEBUG=debug, USE_TMA=use_tma, PERSISTENT=persistent,
                WARP_SPECIALIZE=specialize, PV_SKIP=pv_threshold is not None, FP8=fp8,
                EXACT_CAST=fp8 and interpreting(), SQ=kernel_scales[0], SK=kernel_scales[1], SV=kernel_scales[2],
                num_warps=launch.num_warps, num_stages=stages,
            )
            break
        except OutOfResources:  # raised while compiling, before the launch: retry with one stage fewer
            if stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages
    if fp8 and lse is not None and quantized.q_dot_mean is not None:  # the kernel's LSE: K's mean removed
        lse = lse + scale * quantized.q_dot_mean
    return out, lse, counts


# Pipeline stages per launch variant, lowered once when a variant's shared memory did not fit (launch_config's
# budget leaves no room for the layout conversions of some variants).
_STAGES: dict = {}


def _bnh(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of batch, token and head of a `[B, N, H, D]` tensor."""
    return t.stride(0), t.stride(1), t.stride(2)
