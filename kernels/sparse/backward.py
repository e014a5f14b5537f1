"""The backward pass of sparse attention under a block mask (kernels/sparse/forward.py), flash-attention style.

Semantics are the forward's: query i attends key j exactly when `mask[b, h, i // q_block, j // kv_block]`.
The backward always runs on the unmerged block mask: query merging (`merge=`) only regroups the forward's
programs and never changes an output row, so the gradients are those of the plain mask, and the backward
tiles are runs of consecutive tokens (`BackwardTiles`; a tile may hold several mask blocks or part of one).

Two launches on `[B, N, heads, head_dim]` tensors:
1. `delta_kernel` (kernels/common/backward.py): `delta = rowsum(dO * O) - dLSE` in fp32, head-major as the LSE.
2. `sparse_backward_kernel`, two kinds of programs in one grid: a dK/dV program per KV tile, over the Q tiles
   of its column of the tile mask (`_dkdv_program`), then a dQ program per Q tile, over the KV tiles of its row
   (`_dq_program`).
Both kinds' lists (`tile_lists`) are built on the GPU (kernels/sparse/lists.py), no host round trip, or once
per mask by `prepare_sparse` (a `SparseWork` carries them). A list holds the full pairs first (every query
attends every key, no key past N), which run with no mask code, as the forward's first loop does; the partial
pairs follow, each element masked by its own block's bit (gathered from the boolean mask) and by `token < N`.
Where the tiles cannot hold a partial pair (each tile within one mask block, N a multiple of the key tile), the
masked loop is not built at all (fewer registers spilled). A query that attends nothing (LSE -inf) contributes
nothing. Tiles and gradients move and accumulate in head_dim's power-of-two column chunks
(kernels/common/headdim.py), columns past head_dim read as zeros and never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from ..common.backend import interpreting
from ..common.devices import on_their_device
from ..common.launch import LaunchOptions, descriptors_fit, install_allocator, launch_overrides
from ..common.backward import dkdv_step, dq_step, launch_options, softmax_delta
from ..common.headdim import head_split, load_columns, store_columns
from ..common.softmax import LOG2E
from .lists import build_tile_lists


@triton.jit
def _element_mask(MASK, q_tokens, k_tokens, seq_len, num_kv_blocks, QB: tl.constexpr, KVB: tl.constexpr,
                  KEYS_FIRST: tl.constexpr):
    """Whether query `q_tokens[m]` attends key `k_tokens[n]`: its block pair's bit in the `[nQ, nKV]` mask of
    this (batch, head), both tokens before N; `[BLOCK_N, BLOCK_M]` when KEYS_FIRST, else `[BLOCK_M, BLOCK_N]`."""
    q_ok = q_tokens < seq_len
    k_ok = k_tokens < seq_len
    if KEYS_FIRST:
        bits = tl.load(MASK + (q_tokens // QB)[None, :] * num_kv_blocks + (k_tokens // KVB)[:, None],
                       mask=k_ok[:, None] & q_ok[None, :], other=0)
    else:
        bits = tl.load(MASK + (q_tokens // QB)[:, None] * num_kv_blocks + (k_tokens // KVB)[None, :],
                       mask=q_ok[:, None] & k_ok[None, :], other=0)
    return bits != 0


@triton.jit
def _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads):
    """`lse * log2(e)` (0 for a query that attends nothing, whose every pair is masked) and delta of the rows,
    both head-major (`[B, heads, N]`)."""
    ok = q_tokens < seq_len
    stat = (b * heads + h) * seq_len + q_tokens.to(tl.int64)
    lse = tl.load(LSE + stat, mask=ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    return lse * 1.4426950408889634, tl.load(DELTA + stat, mask=ok, other=0.0)


@triton.jit
def _load_rows(A, tokens, base, seq_len, heads, HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr,
               CHUNK_B: tl.constexpr):
    """Rows `tokens` of one head of a `[B, N, heads, head_dim]` tensor in head_dim's column chunks (`a_a, a_b`;
    the second is the first again when CHUNK_B is 0), zeros at and past N and past head_dim."""
    rows = base + tokens.to(tl.int64) * (heads * HEAD_DIM)
    ok = tokens < seq_len
    a_a = load_columns(A, rows, 0, CHUNK_A, HEAD_DIM, ok)
    a_b = a_a
    if CHUNK_B > 0:
        a_b = load_columns(A, rows, CHUNK_A, CHUNK_B, HEAD_DIM, ok)
    return a_a, a_b


@triton.jit
def _row_descriptor(A, base, seq_len, heads, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr):
    """A tensor descriptor over one head of a `[B, N, heads, head_dim]` tensor (`base`: the head's first element),
    `ROWS` tokens and one column chunk of `WIDTH` columns per load; rows at and past N and columns past head_dim
    read as zeros (the descriptor's last dimension is the head's own head_dim columns)."""
    return tl.make_tensor_descriptor(A + base, shape=[seq_len, HEAD_DIM], strides=[heads * HEAD_DIM, 1],
                                     block_shape=[ROWS, WIDTH])


@triton.jit
def _row_descriptors(A, base, seq_len, heads, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr,
                     CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr):
    """`_row_descriptor`s of one tensor, one per column chunk (the second is the first again when CHUNK_B is 0),
    with USE_TMA; else the bare pointer twice (loads go through pointers)."""
    if USE_TMA:
        d_a = _row_descriptor(A, base, seq_len, heads, ROWS, HEAD_DIM, CHUNK_A)
        d_b = d_a
        if CHUNK_B > 0:
            d_b = _row_descriptor(A, base, seq_len, heads, ROWS, HEAD_DIM, CHUNK_B)
    else:
        d_a = A
        d_b = A
    return d_a, d_b


@triton.jit
def _load_tile(A, desc_a, desc_b, tokens, first, base, seq_len, heads, HEAD_DIM: tl.constexpr,
               CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows `tokens` (consecutive from `first`) of one head of a `[B, N, heads, head_dim]` tensor in head_dim's
    column chunks, zeros at and past N: through tensor descriptors, or pointer loads."""
    if USE_TMA:
        a_a = desc_a.load([first, 0])
        a_b = a_a
        if CHUNK_B > 0:
            a_b = desc_b.load([first, CHUNK_A])
    else:
        a_a, a_b = _load_rows(A, tokens, base, seq_len, heads, HEAD_DIM, CHUNK_A, CHUNK_B)
    return a_a, a_b


@triton.jit
def _store_tile(A, a_a, a_b, tokens, first, base, seq_len, heads, HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr,
                CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr):
    """Store the column chunks `a_a` (and `a_b`) to rows `tokens` (consecutive from `first`) of one head of a
    `[B, N, heads, head_dim]` tensor, rows at and past N and columns past head_dim dropped: through tensor
    descriptors, or pointer stores."""
    if USE_TMA:
        _row_descriptor(A, base, seq_len, heads, a_a.shape[0], HEAD_DIM, CHUNK_A).store(
            [first, 0], a_a.to(A.dtype.element_ty))
        if CHUNK_B > 0:
            _row_descriptor(A, base, seq_len, heads, a_b.shape[0], HEAD_DIM, CHUNK_B).store(
                [first, CHUNK_A], a_b.to(A.dtype.element_ty))
    else:
        rows = base + tokens.to(tl.int64) * (heads * HEAD_DIM)
        ok = tokens < seq_len
        store_columns(A, rows, a_a, 0, CHUNK_A, HEAD_DIM, ok)
        if CHUNK_B > 0:
            store_columns(A, rows, a_b, CHUNK_A, CHUNK_B, HEAD_DIM, ok)


@triton.jit
def _head_and_mask_item(heads, mask_b_step, mask_h_step, mask_heads):
    """This program's batch and head (grid axis 1 runs over batch * heads) and the index of its `[nQ, nKV]`
    block mask, which may be shared along batch or heads (`mask_b_step` / `mask_h_step` 0); all int64."""
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    mask_item = (b * mask_b_step) * mask_heads + h * mask_h_step
    return b.to(tl.int64), h.to(tl.int64), mask_item.to(tl.int64)


@triton.jit
def _dkdv_program(
    kv_tile, Q, K, V, DO, LSE, DELTA, DK, DV, MASK, COL_COUNT, COL_FULL, COL_INDEX,
    seq_len, heads, num_q_blocks, num_kv_blocks, num_q_tiles, num_kv_tiles, mask_b_step, mask_h_step, mask_heads,
    qk_scale, scale,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr, PARTIAL: tl.constexpr,
):
    """KV tile `kv_tile` of BLOCK_N keys: its dK and dV over the Q tiles of its column, the full ones (every
    query attends every key) first and without mask code, then (when the tiles can hold any: PARTIAL) the
    partial ones under the element mask."""
    b, h, mask_item = _head_and_mask_item(heads, mask_b_step, mask_h_step, mask_heads)
    MASK_BH = MASK + mask_item * num_q_blocks * num_kv_blocks
    rows = tl.arange(0, BLOCK_M)
    k_tokens = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    base = b * seq_len * heads * HEAD_DIM + h * HEAD_DIM
    # Every [rows, head_dim] tile and gradient in head_dim's column chunks (kernels/common/headdim.py): `_a`, and
    # `_b` where CHUNK_B is not 0 (else the `_a` one again, never read). Through descriptors with USE_TMA, the
    # program's own tile too: no offsets held across the loop.
    k_desc_a, k_desc_b = _row_descriptors(K, base, seq_len, heads, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    v_desc_a, v_desc_b = _row_descriptors(V, base, seq_len, heads, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    k_a, k_b = _load_tile(K, k_desc_a, k_desc_b, k_tokens, kv_tile * BLOCK_N, base, seq_len, heads, HEAD_DIM,
                          CHUNK_A, CHUNK_B, USE_TMA)
    v_a, v_b = _load_tile(V, v_desc_a, v_desc_b, k_tokens, kv_tile * BLOCK_N, base, seq_len, heads, HEAD_DIM,
                          CHUNK_A, CHUNK_B, USE_TMA)
    q_desc_a, q_desc_b = _row_descriptors(Q, base, seq_len, heads, BLOCK_M, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    do_desc_a, do_desc_b = _row_descriptors(DO, base, seq_len, heads, BLOCK_M, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    dk_a = tl.zeros([BLOCK_N, CHUNK_A], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_N, CHUNK_A], dtype=tl.float32)
    dk_b = dk_a
    dv_b = dv_a
    if CHUNK_B > 0:
        dk_b = tl.zeros([BLOCK_N, CHUNK_B], dtype=tl.float32)
        dv_b = tl.zeros([BLOCK_N, CHUNK_B], dtype=tl.float32)
    column = mask_item * num_kv_tiles + kv_tile
    count = tl.load(COL_COUNT + column)
    full = tl.load(COL_FULL + column)
    INDEX = COL_INDEX + column * num_q_tiles
    for i in tl.range(0, full):
        first = tl.load(INDEX + i) * BLOCK_M
        q_tokens = first + rows
        q_a, q_b = _load_tile(Q, q_desc_a, q_desc_b, q_tokens, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                              CHUNK_B, USE_TMA)
        do_a, do_b = _load_tile(DO, do_desc_a, do_desc_b, q_tokens, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                                CHUNK_B, USE_TMA)
        lse2, delta = _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads)
        dk_a, dk_b, dv_a, dv_b, _ = dkdv_step(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, q_a, q_b, do_a, do_b,
                                              lse2, delta, qk_scale, 0, False, CHUNK_B)
    if PARTIAL:
        for i in tl.range(full, count):
            first = tl.load(INDEX + i) * BLOCK_M
            q_tokens = first + rows
            q_a, q_b = _load_tile(Q, q_desc_a, q_desc_b, q_tokens, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                                  CHUNK_B, USE_TMA)
            do_a, do_b = _load_tile(DO, do_desc_a, do_desc_b, q_tokens, first, base, seq_len, heads, HEAD_DIM,
                                    CHUNK_A, CHUNK_B, USE_TMA)
            lse2, delta = _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads)
            keep = _element_mask(MASK_BH, q_tokens, k_tokens, seq_len, num_kv_blocks, QB, KVB, True)
            dk_a, dk_b, dv_a, dv_b, _ = dkdv_step(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, q_a, q_b, do_a, do_b,
                                                  lse2, delta, qk_scale, keep, True, CHUNK_B)
    _store_tile(DK, dk_a * scale, dk_b * scale, k_tokens, kv_tile * BLOCK_N, base, seq_len, heads, HEAD_DIM,
                CHUNK_A, CHUNK_B, USE_TMA)
    _store_tile(DV, dv_a, dv_b, k_tokens, kv_tile * BLOCK_N, base, seq_len, heads, HEAD_DIM, CHUNK_A, CHUNK_B,
                USE_TMA)


@triton.jit
def _dq_program(
    q_tile, Q, K, V, DO, LSE, DELTA, DQ, MASK, ROW_COUNT, ROW_FULL, ROW_INDEX,
    seq_len, heads, num_q_blocks, num_kv_blocks, num_q_tiles, num_kv_tiles, mask_b_step, mask_h_step, mask_heads,
    qk_scale, scale,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr, USE_TMA: tl.constexpr, PARTIAL: tl.constexpr,
):
    """Q tile `q_tile` of BLOCK_M queries: its dQ over the KV tiles of its row, full ones first and without mask
    code, then (PARTIAL) the partial ones under the element mask."""
    b, h, mask_item = _head_and_mask_item(heads, mask_b_step, mask_h_step, mask_heads)
    MASK_BH = MASK + mask_item * num_q_blocks * num_kv_blocks
    cols = tl.arange(0, BLOCK_N)
    q_tokens = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    base = b * seq_len * heads * HEAD_DIM + h * HEAD_DIM
    # In head_dim's column chunks, as the dK/dV program.
    q_desc_a, q_desc_b = _row_descriptors(Q, base, seq_len, heads, BLOCK_M, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    do_desc_a, do_desc_b = _row_descriptors(DO, base, seq_len, heads, BLOCK_M, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    q_a, q_b = _load_tile(Q, q_desc_a, q_desc_b, q_tokens, q_tile * BLOCK_M, base, seq_len, heads, HEAD_DIM,
                          CHUNK_A, CHUNK_B, USE_TMA)
    do_a, do_b = _load_tile(DO, do_desc_a, do_desc_b, q_tokens, q_tile * BLOCK_M, base, seq_len, heads, HEAD_DIM,
                            CHUNK_A, CHUNK_B, USE_TMA)
    k_desc_a, k_desc_b = _row_descriptors(K, base, seq_len, heads, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    v_desc_a, v_desc_b = _row_descriptors(V, base, seq_len, heads, BLOCK_N, HEAD_DIM, CHUNK_A, CHUNK_B, USE_TMA)
    lse2, delta = _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads)
    dq_a = tl.zeros([BLOCK_M, CHUNK_A], dtype=tl.float32)
    dq_b = dq_a
    if CHUNK_B > 0:
        dq_b = tl.zeros([BLOCK_M, CHUNK_B], dtype=tl.float32)
    row = mask_item * num_q_tiles + q_tile
    count = tl.load(ROW_COUNT + row)
    full = tl.load(ROW_FULL + row)
    INDEX = ROW_INDEX + row * num_kv_tiles
    for i in tl.range(0, full):
        first = tl.load(INDEX + i) * BLOCK_N
        k_a, k_b = _load_tile(K, k_desc_a, k_desc_b, first + cols, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                              CHUNK_B, USE_TMA)
        v_a, v_b = _load_tile(V, v_desc_a, v_desc_b, first + cols, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                              CHUNK_B, USE_TMA)
        dq_a, dq_b = dq_step(dq_a, dq_b, q_a, q_b, do_a, do_b, k_a, k_b, v_a, v_b, lse2, delta, qk_scale, 0, False,
                             CHUNK_B)
    if PARTIAL:
        for i in tl.range(full, count):
            first = tl.load(INDEX + i) * BLOCK_N
            k_tokens = first + cols
            k_a, k_b = _load_tile(K, k_desc_a, k_desc_b, k_tokens, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                                  CHUNK_B, USE_TMA)
            v_a, v_b = _load_tile(V, v_desc_a, v_desc_b, k_tokens, first, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                                  CHUNK_B, USE_TMA)
            keep = _element_mask(MASK_BH, q_tokens, k_tokens, seq_len, num_kv_blocks, QB, KVB, False)
            dq_a, dq_b = dq_step(dq_a, dq_b, q_a, q_b, do_a, do_b, k_a, k_b, v_a, v_b, lse2, delta, qk_scale, keep,
                                 True, CHUNK_B)
    _store_tile(DQ, dq_a * scale, dq_b * scale, q_tokens, q_tile * BLOCK_M, base, seq_len, heads, HEAD_DIM, CHUNK_A,
                CHUNK_B, USE_TMA)


@triton.jit
def sparse_backward_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, MASK, COL_COUNT, COL_FULL, COL_INDEX, ROW_COUNT, ROW_FULL, ROW_INDEX,
    seq_len, heads, num_q_blocks, num_kv_blocks, dkdv_q_tiles, dkdv_kv_tiles, dq_q_tiles, dq_kv_tiles,
    mask_b_step, mask_h_step, mask_heads, qk_scale, scale,
    QB: tl.constexpr, KVB: tl.constexpr, DKDV_M: tl.constexpr, DKDV_N: tl.constexpr, DQ_M: tl.constexpr,
    DQ_N: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_A: tl.constexpr, CHUNK_B: tl.constexpr,
    USE_TMA: tl.constexpr, DKDV_PARTIAL: tl.constexpr, DQ_PARTIAL: tl.constexpr,
):
    """The dK/dV and the dQ programs in one launch (grid: dK/dV's KV tiles + dQ's Q tiles, x batch * heads): the
    dK/dV programs first (the longer ones), then the dQ programs, which fill the SMs that the last dK/dV
    programs leave idle instead of waiting for a second launch (H100, random 128x128 masks, 24 heads: 2-6%
    faster than two launches; benchmarks/results/sparse-backward-fused-*.json)."""
    pid = tl.program_id(0)
    if pid < dkdv_kv_tiles:
        _dkdv_program(pid, Q, K, V, DO, LSE, DELTA, DK, DV, MASK, COL_COUNT, COL_FULL, COL_INDEX,
                      seq_len, heads, num_q_blocks, num_kv_blocks, dkdv_q_tiles, dkdv_kv_tiles, mask_b_step,
                      mask_h_step, mask_heads, qk_scale, scale, QB, KVB, DKDV_M, DKDV_N, HEAD_DIM, CHUNK_A, CHUNK_B,
                      USE_TMA, DKDV_PARTIAL)
    else:
        _dq_program(pid - dkdv_kv_tiles, Q, K, V, DO, LSE, DELTA, DQ, MASK, ROW_COUNT, ROW_FULL, ROW_INDEX,
                    seq_len, heads, num_q_blocks, num_kv_blocks, dq_q_tiles, dq_kv_tiles, mask_b_step,
                    mask_h_step, mask_heads, qk_scale, scale, QB, KVB, DQ_M, DQ_N, HEAD_DIM, CHUNK_A, CHUNK_B,
                    USE_TMA, DQ_PARTIAL)


# -- host side ---------------------------------------------------------------------------------------------------

# Pipeline stages of the backward kernel: two, at which its 64 x 64 tiles compile without spills (three spill 20
# bytes) and two programs fit an SM (H100, 128 x 128 masks: 3-8% faster than three;
# sparse-backward-tiles-*-2026-11-25.json).
STAGES = 2


@dataclass(frozen=True)
class BackwardTiles:
    """Tokens per tile of the two backward kernels: the dK/dV kernel's programs hold `dkdv_keys` keys and step
    over `dkdv_queries` queries at a time; the dQ kernel's hold `dq_queries` queries and step over `dq_keys` keys.
    Powers of two of at least 16; a tile may be smaller or larger than the mask's blocks."""

    dkdv_queries: int
    dkdv_keys: int
    dq_queries: int
    dq_keys: int


def backward_tiles(q_block: int, kv_block: int, device: torch.device) -> BackwardTiles:
    """The default tiles: 64 x 64 on the GPU, whatever the mask's blocks, so that no tile straddles two 64-token
    blocks (a straddling tile runs under the element mask whenever its blocks differ: twice as slow at 64 x 64
    blocks) and the kernel runs at 4 warps in under half the shared memory, two programs per SM, which hide each
    other's waits (H100, head_dim 128, 128 x 128 masks: 8-13% faster than programs of 128 keys or queries at
    8 warps, one per SM; benchmarks/results/sparse-backward-tiles-*-2026-11-25.json). 16 x 16 in the
    interpreter."""
    if interpreting() and device.type == "cpu":
        return BackwardTiles(16, 16, 16, 16)
    return BackwardTiles(64, 64, 64, 64)


@dataclass(frozen=True)
class TileList:
    """One kernel's work over its tile mask `[B|1, H|1, rows, cols]`: per row, `count` listed tiles (a pair is
    listed when any of its query-key pairs is attended), the first `full` of which are full (every query of the
    pair attends every key), then the partial ones; `index` holds each row's listed columns in that order (int32,
    `[B|1, H|1, rows, cols]`; entries past `count` carry no meaning)."""

    count: torch.Tensor
    full: torch.Tensor
    index: torch.Tensor


def _tile_flags(mask: torch.Tensor, tile_q: int, tile_k: int, q_block: int, kv_block: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full) `[B|1, H|1, ceil(N / tile_q), ceil(N / tile_k)]` of a boolean block mask: a tile pair is
    listed when any of its block pairs is attended, and full when every block pair of it that holds a query
    before N is and no key of it lies at or past N (the kernels read such keys as zeros, and an unmasked score of
    0 against a query's LSE could overflow). Tiles smaller than a block repeat the block's bit."""
    num_rows, num_cols = -(-seq_len // tile_q), -(-seq_len // tile_k)
    if tile_q < q_block:
        mask = mask.repeat_interleave(q_block // tile_q, dim=2)[:, :, :num_rows]
    if tile_k < kv_block:
        mask = mask.repeat_interleave(kv_block // tile_k, dim=3)[:, :, :, :num_cols]
    r, c = max(tile_q // q_block, 1), max(tile_k // kv_block, 1)
    batch, heads, nq, nkv = mask.shape
    keys_before_n = torch.arange(num_cols, device=mask.device) < seq_len // tile_k
    if (r, c) == (1, 1):
        return mask, mask & keys_before_n
    listed = mask.new_zeros((batch, heads, num_rows * r, num_cols * c))
    listed[:, :, :nq, :nkv] = mask
    full = listed.clone()
    full[:, :, nq:] = True  # query blocks past N hold no query: they never make a tile partial
    listed = listed.view(batch, heads, num_rows, r, num_cols, c).any(5).any(3)
    full = full.view(batch, heads, num_rows, r, num_cols, c).all(5).all(3)
    return listed, full & keys_before_n


def _ordered(listed: torch.Tensor, full: torch.Tensor) -> TileList:
    """Each row's listed columns, full ones first, both runs in ascending order."""
    rank = torch.where(full, 0, torch.where(listed, 1, 2)).to(torch.int8)
    index = torch.sort(rank, dim=-1, stable=True).indices.to(torch.int32)
    return TileList(listed.sum(-1, dtype=torch.int32).contiguous(), full.sum(-1, dtype=torch.int32).contiguous(),
                    index.contiguous())


def tile_lists(mask: torch.Tensor, tiles: BackwardTiles, q_block: int, kv_block: int,
               seq_len: int) -> tuple[TileList, TileList]:
    """The dK/dV kernel's column lists and the dQ kernel's row lists of a boolean block mask `[B|1, H|1, nQ,
    nKV]`, on the mask's device with no host round trip: one Triton launch per list on the GPU
    (kernels/sparse/lists.py), torch ops elsewhere."""
    if mask.is_cuda:
        sizes = (tiles.dkdv_queries, tiles.dkdv_keys, q_block, kv_block, seq_len)
        columns = TileList(*build_tile_lists(mask, *sizes, by_keys=True))
        sizes = (tiles.dq_queries, tiles.dq_keys, q_block, kv_block, seq_len)
        return columns, TileList(*build_tile_lists(mask, *sizes, by_keys=False))
    listed, full = _tile_flags(mask, tiles.dkdv_queries, tiles.dkdv_keys, q_block, kv_block, seq_len)
    columns = _ordered(listed.transpose(2, 3), full.transpose(2, 3))
    listed, full = _tile_flags(mask, tiles.dq_queries, tiles.dq_keys, q_block, kv_block, seq_len)
    return columns, _ordered(listed, full)


# The launch options (kernels/common/launch.py, `LaunchOptions`) the backward kernel reads: what `options` may set.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "USE_TMA")


@on_their_device
def sparse_backward(q, k, v, out, lse, grad_out, grad_lse, mask: torch.Tensor, q_block: int, kv_block: int,
                    scale: Optional[float] = None, tiles: Optional[BackwardTiles] = None,
                    lists: Optional[tuple[TileList, TileList]] = None,
                    options: Optional[Mapping[str, object]] = None):
    """dq, dk, dv of sparse attention of `[B, N, H, D]` tensors under the boolean block mask `[B|1, H|1, nQ,
    nKV]`, from the forward's output and natural-log LSE `[B, N, H]` (-inf for a query that attends nothing);
    `grad_lse` may be None. `tiles` overrides `backward_tiles`; `lists` are `tile_lists` of the mask at those
    tiles when prepared beforehand (a `SparseWork` carries them); `options` override the launch options
    (`LAUNCH_OPTIONS`; `USE_TMA` off loads the stepped operands with pointers, on leaves it to the tensors)."""
    batch, seq_len, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    tiles = backward_tiles(q_block, kv_block, q.device) if tiles is None else tiles
    split = head_split(head_dim)
    default = launch_options(max(tiles.dkdv_queries, tiles.dq_queries), max(tiles.dkdv_keys, tiles.dq_keys), split)
    launch = replace(default, num_stages=STAGES, USE_TMA=True).overridden(
        launch_overrides(options, "options", LAUNCH_OPTIONS))
    q, k, v, out, grad_out = (t.detach().contiguous() for t in (q, k, v, out, grad_out.to(q.dtype)))
    lse = lse.detach().float().transpose(1, 2).contiguous()  # head-major, as delta
    mask = mask.to(q.device, torch.bool).contiguous()
    columns, rows = tile_lists(mask, tiles, q_block, kv_block, seq_len) if lists is None else lists
    delta = softmax_delta(out, grad_out, None if grad_lse is None else grad_lse.detach().float().contiguous())
    use_tma = _use_descriptors(launch, q, k, v, grad_out)
    if use_tma:
        install_allocator()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dkdv_kv_tiles, dq_q_tiles = columns.count.shape[-1], rows.count.shape[-1]
    sparse_backward_kernel[(dkdv_kv_tiles + dq_q_tiles, batch * heads)](
        q, k, v, grad_out, lse, delta, dq, dk, dv, mask.view(torch.uint8), columns.count, columns.full,
        columns.index, rows.count, rows.full, rows.index, seq_len=seq_len, heads=heads, num_q_blocks=mask.shape[2],
        num_kv_blocks=mask.shape[3], dkdv_q_tiles=columns.index.shape[-1], dkdv_kv_tiles=dkdv_kv_tiles,
        dq_q_tiles=dq_q_tiles, dq_kv_tiles=rows.index.shape[-1], mask_b_step=0 if mask.shape[0] == 1 else 1,
        mask_h_step=0 if mask.shape[1] == 1 else 1, mask_heads=mask.shape[1], qk_scale=scale * LOG2E, scale=scale,
        QB=q_block, KVB=kv_block, DKDV_M=tiles.dkdv_queries, DKDV_N=tiles.dkdv_keys, DQ_M=tiles.dq_queries,
        DQ_N=tiles.dq_keys, **split.constexprs(), USE_TMA=use_tma,
        DKDV_PARTIAL=_may_hold_partial_pairs(tiles.dkdv_queries, tiles.dkdv_keys, q_block, kv_block, seq_len),
        DQ_PARTIAL=_may_hold_partial_pairs(tiles.dq_queries, tiles.dq_keys, q_block, kv_block, seq_len),
        **launch.triton_options())
    return dq, dk, dv


def _may_hold_partial_pairs(tile_q: int, tile_k: int, q_block: int, kv_block: int, seq_len: int) -> bool:
    """Whether a kernel's tile pairs can be partial (some query-key pair of a listed pair not attended): only
    where a tile spans several mask blocks, or the last key tile reaches past N. Otherwise its kernel is built
    without the masked loop."""
    return tile_q > q_block or tile_k > kv_block or seq_len % tile_k != 0


def _use_descriptors(launch: LaunchOptions, q, k, v, grad_out) -> bool:
    """Whether the stepped operands load through tensor descriptors: where `launch.USE_TMA` allows them, on
    Hopper and later (or in the interpreter), with the strides and alignment TMA needs."""
    return bool(launch.USE_TMA) and descriptors_fit(q, k, v, grad_out)
