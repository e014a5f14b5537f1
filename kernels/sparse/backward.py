"""The backward pass of sparse attention under a block mask (kernels/sparse/forward.py), flash-attention style.

Semantics are the forward's: query i attends key j exactly when `mask[b, h, i // q_block, j // kv_block]`.
The backward always runs on the unmerged block mask: query merging (`merge=`) only regroups the forward's
programs and never changes an output row, so the gradients are those of the plain mask, and the backward
tiles are runs of consecutive tokens (`block_m` queries, `block_n` keys; multiples of the mask's blocks).

Three launches on `[B, N, heads, head_dim]` tensors:
1. `delta_kernel` (kernels/common/backward.py): `delta = rowsum(dO * O) - dLSE` in fp32, head-major as the LSE.
2. `sparse_dkdv_kernel`: one program per KV tile, over the Q tiles of its column of the tile mask.
3. `sparse_dq_kernel`: one program per Q tile, over the KV tiles of its row.
The tile mask (a tile pair is listed when any of its block pairs is attended) and its row and column lists
are built on the GPU with torch ops (`tile_lists`): the transposed lists are a sort of the transposed tile
mask, no host round trip. Inside a listed pair every element is masked by its own block's bit (gathered from
the boolean mask) and by `token < N`; a query that attends nothing (LSE -inf) contributes nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..common.backend import interpreting
from ..common.backward import dkdv_step, dq_step, launch_options, softmax_delta
from ..common.softmax import LOG2E


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
def _load_rows(A, B, tokens, base, seq_len, heads, HEAD_DIM: tl.constexpr):
    """Rows `tokens` of one head of two `[B, N, heads, head_dim]` tensors (zeros at and past N), their element
    offsets from the tensors' start and which of them are real (`[rows, 1]`)."""
    offsets = base + tokens.to(tl.int64)[:, None] * (heads * HEAD_DIM) + tl.arange(0, HEAD_DIM)[None, :]
    ok = (tokens < seq_len)[:, None]
    return tl.load(A + offsets, mask=ok, other=0.0), tl.load(B + offsets, mask=ok, other=0.0), offsets, ok


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
def sparse_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK, COL_COUNT, COL_INDEX,
    seq_len, heads, num_q_blocks, num_kv_blocks, num_q_tiles, num_kv_tiles, mask_b_step, mask_h_step, mask_heads,
    qk_scale, scale,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    kv_tile = tl.program_id(0)
    b, h, mask_item = _head_and_mask_item(heads, mask_b_step, mask_h_step, mask_heads)
    MASK_BH = MASK + mask_item * num_q_blocks * num_kv_blocks
    rows = tl.arange(0, BLOCK_M)
    k_tokens = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    base = b * seq_len * heads * HEAD_DIM + h * HEAD_DIM
    k, v, kv_offsets, k_ok = _load_rows(K, V, k_tokens, base, seq_len, heads, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    column = mask_item * num_kv_tiles + kv_tile
    count = tl.load(COL_COUNT + column)
    for i in tl.range(0, count):
        q_tile = tl.load(COL_INDEX + column * num_q_tiles + i)
        q_tokens = q_tile * BLOCK_M + rows
        q, do, _, _ = _load_rows(Q, DO, q_tokens, base, seq_len, heads, HEAD_DIM)
        lse2, delta = _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads)
        keep = _element_mask(MASK_BH, q_tokens, k_tokens, seq_len, num_kv_blocks, QB, KVB, True)
        dk, dv, _ = dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, keep, True)
    tl.store(DK + kv_offsets, (dk * scale).to(DK.dtype.element_ty), mask=k_ok)
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=k_ok)


@triton.jit
def sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, MASK, ROW_COUNT, ROW_INDEX,
    seq_len, heads, num_q_blocks, num_kv_blocks, num_q_tiles, num_kv_tiles, mask_b_step, mask_h_step, mask_heads,
    qk_scale, scale,
    QB: tl.constexpr, KVB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    q_tile = tl.program_id(0)
    b, h, mask_item = _head_and_mask_item(heads, mask_b_step, mask_h_step, mask_heads)
    MASK_BH = MASK + mask_item * num_q_blocks * num_kv_blocks
    cols = tl.arange(0, BLOCK_N)
    q_tokens = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    base = b * seq_len * heads * HEAD_DIM + h * HEAD_DIM
    q, do, q_offsets, q_ok = _load_rows(Q, DO, q_tokens, base, seq_len, heads, HEAD_DIM)
    lse2, delta = _row_stats(LSE, DELTA, q_tokens, seq_len, b, h, heads)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row = mask_item * num_q_tiles + q_tile
    count = tl.load(ROW_COUNT + row)
    for i in tl.range(0, count):
        kv_tile = tl.load(ROW_INDEX + row * num_kv_tiles + i)
        k_tokens = kv_tile * BLOCK_N + cols
        k, v, _, _ = _load_rows(K, V, k_tokens, base, seq_len, heads, HEAD_DIM)
        keep = _element_mask(MASK_BH, q_tokens, k_tokens, seq_len, num_kv_blocks, QB, KVB, False)
        dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, keep, True)
    tl.store(DQ + q_offsets, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


# -- host side ---------------------------------------------------------------------------------------------------


def backward_blocks(q_block: int, kv_block: int, device: torch.device) -> tuple[int, int]:
    """(block_m, block_n), queries and keys per backward tile: 64 x 128 on the GPU (the GNA backward's
    shapes), 16 x 16 in the interpreter, never below the mask's blocks."""
    small = interpreting() and device.type == "cpu"
    return max(q_block, 16 if small else 64), max(kv_block, 16 if small else 128)


def _ordered_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a boolean `[..., rows, cols]` tile mask: its count and its listed columns in ascending order
    first (int32, `[..., rows, cols]`; entries past the count carry no meaning)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts.contiguous(), order.contiguous()


def tile_lists(mask: torch.Tensor, block_m: int, block_n: int, q_block: int, kv_block: int):
    """The tile mask of a boolean block mask `[B|1, H|1, nQ, nKV]` (a pair of `block_m`-query and `block_n`-key
    tiles is listed when any of its block pairs is attended), and its row and column lists: `(row_count,
    row_index, col_count, col_index)`, built with torch ops on the mask's device."""
    r, c = block_m // q_block, block_n // kv_block
    batch, heads, nq, nkv = mask.shape
    nqt, nkt = -(-nq // r), -(-nkv // c)
    padded = mask.new_zeros((batch, heads, nqt * r, nkt * c))
    padded[:, :, :nq, :nkv] = mask
    tiles = padded.view(batch, heads, nqt, r, nkt, c).any(5).any(3)
    row_count, row_index = _ordered_lists(tiles)
    col_count, col_index = _ordered_lists(tiles.transpose(2, 3))
    return row_count, row_index, col_count, col_index


def sparse_backward(q, k, v, out, lse, grad_out, grad_lse, mask: torch.Tensor, q_block: int, kv_block: int,
                    scale: Optional[float] = None, blocks: Optional[tuple[int, int]] = None):
    """dq, dk, dv of sparse attention of `[B, N, H, D]` tensors under the boolean block mask `[B|1, H|1, nQ,
    nKV]`, from the forward's output and natural-log LSE `[B, N, H]` (-inf for a query that attends nothing);
    `grad_lse` may be None. `blocks=(block_m, block_n)` overrides `backward_blocks` (multiples of the mask's
    blocks, powers of two of at least 16)."""
    batch, seq_len, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    block_m, block_n = backward_blocks(q_block, kv_block, q.device) if blocks is None else blocks
    q, k, v, out, grad_out = (t.detach().contiguous() for t in (q, k, v, out, grad_out.to(q.dtype)))
    lse = lse.detach().float().transpose(1, 2).contiguous()  # head-major, as delta
    mask = mask.to(q.device, torch.bool).contiguous()
    row_count, row_index, col_count, col_index = tile_lists(mask, block_m, block_n, q_block, kv_block)
    delta = softmax_delta(out, grad_out, None if grad_lse is None else grad_lse.detach().float().contiguous())
    num_q_tiles, num_kv_tiles = row_count.shape[-1], col_count.shape[-1]
    shared = dict(seq_len=seq_len, heads=heads, num_q_blocks=mask.shape[2], num_kv_blocks=mask.shape[3],
                  num_q_tiles=num_q_tiles, num_kv_tiles=num_kv_tiles, mask_b_step=0 if mask.shape[0] == 1 else 1,
                  mask_h_step=0 if mask.shape[1] == 1 else 1, mask_heads=mask.shape[1], qk_scale=scale * LOG2E,
                  scale=scale, QB=q_block, KVB=kv_block, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
                  **launch_options(block_m, block_n))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mask_bytes = mask.view(torch.uint8)
    sparse_dkdv_kernel[(num_kv_tiles, batch * heads)](q, k, v, grad_out, lse, delta, dk, dv, mask_bytes, col_count,
                                                      col_index, **shared)
    sparse_dq_kernel[(num_q_tiles, batch * heads)](q, k, v, grad_out, lse, delta, dq, mask_bytes, row_count,
                                                   row_index, **shared)
    return dq, dk, dv
